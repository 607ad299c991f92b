"""Side by side with Flower's own SecAgg+ (flwr 1.42's legacy ``SecAggPlusWorkflow`` and
``secaggplus_mod``), docs/architecture.md section 8:

* one node drops before its masked input: Flower's round aborts (it insists on shares of a
  node that never shared), this adapter's round completes with the exact sum;
* a server that names one node both alive and dead in the unmask request gets both of its
  secrets from Flower's mod and recovers that node's update; this adapter's node refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import FitIns, bytes_to_ndarray, ndarrays_to_parameters
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    get_parameters_shape,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fl.flower import SecureAggregation
from fl.flower.local import LocalGrid
from tests.flower import apps

NODES = 5


class _Legacy(NumPyClient):  # type: ignore[misc]
    def __init__(self, node_id: int) -> None:
        self.node_id = node_id

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
            ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        content = apps.reply_content(self.node_id, 1)
        arrays = [content["arrays"][k].numpy() for k in apps.SHAPES]
        return arrays, int(content["metrics"]["num-examples"]), {}


def _legacy_app(drop: tuple[int, str] | None) -> ClientApp:
    def drop_mod(msg: Message, context: Context, call_next: Any) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if drop is not None and configs is not None and (
                msg.metadata.dst_node_id, configs.get(Key.STAGE)) == drop:
            raise RuntimeError("planned dropout")
        return call_next(msg, context)

    return ClientApp(client_fn=lambda context: _Legacy(context.node_id).to_client(),
                     mods=[drop_mod, secaggplus_mod])


class _RecordingFedAvg(LegacyFedAvg):  # type: ignore[misc]
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.aggregated = 0

    def aggregate_fit(self, *args: Any, **kwargs: Any) -> Any:
        self.aggregated += 1
        return super().aggregate_fit(*args, **kwargs)


def test_a_dropout_before_the_masked_input_aborts_flowers_round_and_not_this_one() -> None:
    grid = LocalGrid(None, NODES)
    leaver = grid.nodes[2]
    grid.app = _legacy_app((leaver, Stage.SHARE_KEYS))
    strategy = _RecordingFedAvg(
        fraction_evaluate=0.0, min_available_clients=NODES, min_fit_clients=NODES,
        initial_parameters=ndarrays_to_parameters(
            [np.zeros(s, np.float32) for s in apps.SHAPES.values()]))
    context = LegacyContext(context=Context(run_id=grid.run.run_id, node_id=0, node_config={},
                                            state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), strategy=strategy)
    DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=NODES,
                                                    reconstruction_threshold=3))(grid, context)
    assert strategy.aggregated == 0  # Flower's SecAgg+ halted: no aggregate this round

    grid = LocalGrid(None, NODES)
    leaver = grid.nodes[2]
    grid.app = apps.client_app(
        lambda node, rnd, roster: "share_keys" if node == leaver else None)
    wrapper = SecureAggregation(FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES),
                                neighbors=None, threshold=3)
    wrapper.start(grid, apps.initial_arrays(), num_rounds=1, timeout=5)
    (report,) = wrapper.reports
    assert report.aborted is None and report.dropped == {leaver: "share_keys"}
    assert report.included == frozenset(grid.nodes) - {leaver}
    assert np.array_equal(report.total, apps.expected_total(report))


def _stage(grid: LocalGrid, node: int, configs: dict[str, Any],
           content: RecordDict | None = None) -> ConfigRecord:
    body = content if content is not None else RecordDict()
    body.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(configs)
    reply = grid.deliver(Message(body, dst_node_id=node, message_type=MessageType.TRAIN))
    assert reply is not None and not reply.has_error(), reply
    return reply.content.config_records[RECORD_KEY_CONFIGS]


def test_the_both_shares_request_recovers_an_update_from_flowers_mod() -> None:
    """A server drives Flower's mod honestly up to the unmask stage, then names the victim
    as alive *and* dead: the replies carry both of its secrets, and its masked input
    unmasks to its own update. (This adapter's node refuses the same request:
    test_adapter.py::test_the_both_shares_request_is_refused_and_the_round_secrets_erased.)"""
    grid = LocalGrid(_legacy_app(None), NODES)
    nodes, t, mod_range = grid.nodes, 3, 1 << 32
    setup = {Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: NODES, Key.SHARE_NUMBER: NODES,
             Key.THRESHOLD: t, Key.CLIPPING_RANGE: 8.0, Key.TARGET_RANGE: 1 << 22,
             Key.MOD_RANGE: mod_range, Key.MAX_WEIGHT: 1000.0}
    keys = {n: _stage(grid, n, dict(setup)) for n in nodes}
    public = {n: [keys[n][Key.PUBLIC_KEY_1], keys[n][Key.PUBLIC_KEY_2]] for n in nodes}
    shares = {n: _stage(grid, n, {Key.STAGE: Stage.SHARE_KEYS,
                                  **{str(m): public[m] for m in nodes}}) for n in nodes}
    forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in nodes}
    for src, reply in shares.items():
        for dst, ciphertext in zip(reply[Key.DESTINATION_LIST], reply[Key.CIPHERTEXT_LIST],
                                   strict=True):
            forward[dst][0].append(src)
            forward[dst][1].append(ciphertext)
    fitins = FitIns(ndarrays_to_parameters([np.zeros(s, np.float32)
                                            for s in apps.SHAPES.values()]), {})
    masked = {n: _stage(grid, n, {Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                                  Key.SOURCE_LIST: forward[n][0],
                                  Key.CIPHERTEXT_LIST: forward[n][1]},
                        compat.fitins_to_recorddict(fitins, True)) for n in nodes}
    victim = nodes[0]
    others = [n for n in nodes if n != victim]
    seed_shares, key_shares = [], []
    for n in others[:t]:
        reply = _stage(grid, n, {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: nodes,
                                 Key.DEAD_NODE_ID_LIST: [victim]})
        pairs = list(zip(reply[Key.NODE_ID_LIST], reply[Key.SHARE_LIST], strict=True))
        owners = [owner for owner, _ in pairs]
        assert owners.count(victim) == 2  # both secrets of one node, in one answer
        first, second = (share for owner, share in pairs if owner == victim)
        seed_shares.append(first)
        key_shares.append(second)
    seed, sk1 = combine_shares(seed_shares), combine_shares(key_shares)
    vector = [bytes_to_ndarray(b) for b in masked[victim][Key.MASKED_PARAMETERS]]
    shape = get_parameters_shape(vector)
    vector = parameters_subtraction(vector, pseudo_rand_gen(seed, mod_range, shape))
    for peer in others:
        shared = generate_shared_key(bytes_to_private_key(sk1),
                                     bytes_to_public_key(public[peer][0]))
        mask = pseudo_rand_gen(shared, mod_range, shape)
        vector = (parameters_subtraction(vector, mask) if victim > peer
                  else parameters_addition(vector, mask))
    ratio, quantized = factor_extract(parameters_mod(vector, mod_range))
    recovered = [v * ((1 << 22) / ratio) for v in dequantize(quantized, 8.0, 1 << 22)]
    truth = apps.reply_content(victim, 1)["arrays"]
    for value, name in zip(recovered, apps.SHAPES, strict=True):
        # up to Flower's quantization step (16 / 2**22 over the weight ratio w / 1000)
        np.testing.assert_allclose(value, truth[name].numpy(), atol=1e-3)
