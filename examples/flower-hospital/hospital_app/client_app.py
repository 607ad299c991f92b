"""The hospital's ClientApp: an ordinary Flower train function. The one secagg line is
``mods=[secagg_mod]``: the reply's arrays and metrics are then securely aggregated and
never leave the hospital in clear. The node's privacy policy and ledger are its operator's
(node config ``secagg-policy``, ``secagg-dp``, ``secagg-ledger``; docs/flower.md)."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl.flower import secagg_mod
from hospital_app import task

app = ClientApp(mods=[secagg_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    partition = int(context.node_config["partition-id"])
    hospitals = int(context.node_config["num-partitions"])
    seed = int(cfg["seed"])
    table = task.hospital_table(partition, hospitals, int(cfg["num-patients"]), seed)
    model = task.new_model(table)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    server_round = int(msg.content["config"]["server-round"])
    loss = task.train(model, table, epochs=int(cfg["local-epochs"]),
                      lr=float(cfg["learning-rate"]), batch_size=int(cfg["batch-size"]),
                      seed=seed * 1000 + server_round * 100 + partition)
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(table)})
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics}),
                   reply_to=msg)
