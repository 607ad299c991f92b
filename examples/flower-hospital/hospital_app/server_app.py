"""The federation's ServerApp: Flower's FedAvg, evaluated centrally on held-out patients.
The one secagg line wraps the strategy: ``SecureAggregation(FedAvg(...))``."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fl.flower import DistributedDP, SecureAggregation
from hospital_app import task

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    rounds, seed = int(cfg["num-server-rounds"]), int(cfg["seed"])
    test = task.test_table(int(cfg["num-patients"]), seed)
    model = task.new_model(test)
    epsilon = float(cfg["dp-epsilon"])
    privacy = (DistributedDP(clip_norm=float(cfg["dp-clip-norm"]), epsilon=epsilon,
                             rounds=rounds) if epsilon > 0 else None)
    hospitals = int(cfg["hospitals"])
    strategy = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_train_nodes=hospitals,
                                        min_available_nodes=hospitals),
                                 dropout_rate=float(cfg["dropout-rate"]), privacy=privacy,
                                 metrics=() if privacy else ("train_loss",))

    def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        # Flower evaluates after each round's aggregation (and once before round 1): the
        # round's secure report is complete here, so its summary is printed as it ends.
        for report in strategy.reports:
            if report.server_round == server_round:
                print(f"round {report.server_round}: {len(report.included)} hospitals "
                      f"summed, dropped {report.dropped or 'none'}, secure round "
                      f"{sum(report.seconds.values()):.2f} s"
                      + (f", epsilon {report.epsilon:.2f}" if report.epsilon is not None
                         else ""), flush=True)
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = task.evaluate(model, test)
        return MetricRecord({"loss": loss, "accuracy": accuracy})

    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=rounds,
                   evaluate_fn=central_evaluation)
