"""The test ClientApp: deterministic replies; the node with partition-id 0 drops out
before its masked input (it raises when asked for it)."""

from __future__ import annotations

from typing import Any

from flwr.app import Context, Message

from fl.flower import secagg_mod
from tests.flower import apps


def partition_zero_drops(msg: Message, context: Context, call_next: Any) -> Message:
    if context.node_config.get("partition-id") == 0 and apps.stage_of(msg) == "masked_input":
        raise apps.Dropout("partition 0 drops before its masked input")
    return call_next(msg, context)


app = apps.client_app(mods=[partition_zero_drops, secagg_mod])
