"""The federation messages of ``fl.remote``: hostile input raises ``WireError``, never more."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from fl.contribution import RoundTask
from fl.remote.blob import Blob
from fl.remote.inputs import SiteData, site_input
from fl.remote.messages import (
    Announce,
    Fetch,
    Hello,
    Ready,
    WireError,
    decode_coordinator_message,
    decode_site_message,
    encode_message,
    round_context,
)
from tests.fl.site_cores import site_core
from transport.control import ControlError

RUN = bytes(range(100, 116))  # fixed: a parameter id, the same in every collecting process
DIGEST = bytes(range(32))


def announce(**changes: object) -> Announce:
    fields = {"run": RUN, "round": 3, "attempt": 0, "kind": "train", "name": "r1",
              "cohort": (1, 2, 3), "blob": DIGEST, "size": 100}
    fields.update(changes)
    return Announce(**fields)  # type: ignore[arg-type]


def test_messages_round_trip() -> None:
    go = announce(phase="go", roster=(1, 3), threshold=2, verify=True)
    assert decode_coordinator_message(encode_message(go)) == go
    hello = Hello(2, ("a", "b"), RUN)
    assert decode_site_message(encode_message(hello), "hello", 2) == hello
    ready = Ready(RUN, 3, 0, "train", DIGEST, np.arange(4, dtype="<u8").tobytes())
    assert decode_site_message(encode_message(ready), "ready", 2, 64) == ready


@pytest.mark.parametrize("payload", [
    b"", b"\x00" * 40, msgpack.packb([1, 2]), msgpack.packb({"t": "announce"}),
    msgpack.packb({"t": "announce", "v": 1}), msgpack.packb({"v": 99, "t": "done"}),
    encode_message(announce(name="../x")), encode_message(announce(cohort=())),
    encode_message(announce(phase="go", roster=(1, 4), threshold=2)),
    encode_message(announce(phase="go", roster=(1, 2), threshold=1)),
    encode_message(announce(blob=b"short")),
])
def test_hostile_coordinator_messages_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_coordinator_message(payload)
    with pytest.raises(ControlError):  # one error family with transport's control codec
        decode_coordinator_message(payload)


def test_a_hello_carries_no_label_values() -> None:
    """A site's label set (e.g. whether it treats a rare diagnosis) never leaves it."""
    body = msgpack.unpackb(encode_message(Hello(2, ("age", "bp"), RUN)))
    assert set(body) == {"t", "v", "site", "features", "run"}


def test_site_messages_are_checked_against_their_topic() -> None:
    hello = encode_message(Hello(2, ("a",)))
    with pytest.raises(WireError, match="says hello as site 2"):
        decode_site_message(hello, "hello", 3)
    with pytest.raises(WireError, match="on the 'ready' topic"):
        decode_site_message(hello, "ready", 2)
    with pytest.raises(WireError):
        decode_site_message(encode_message(Fetch(b"x")), "fetch", 2)
    big = Ready(RUN, 1, 0, "train", DIGEST, b"\x00" * 80)
    with pytest.raises(WireError, match="size limit"):
        decode_site_message(encode_message(big), "ready", 2, max_input_bytes=64)


def test_blob_validation() -> None:
    blob = Blob("train", {"a": 1}, np.arange(3.0), (np.zeros(2), np.ones(2)))
    back = Blob.decode(blob.encode())
    assert back.kind == "train" and np.array_equal(back.model, np.arange(3.0))
    with pytest.raises(WireError, match="NaN"):
        Blob.decode(Blob("train", {}, np.array([np.nan])).encode())
    with pytest.raises(WireError, match="non-positive std"):
        Blob.decode(Blob("train", {}, np.zeros(1), (np.zeros(2), np.zeros(2))).encode())
    with pytest.raises(WireError, match="without a model"):
        Blob.decode(Blob("train", {}).encode())


def test_context_binds_the_blob_digest() -> None:
    a = round_context("fed", announce())
    assert a != round_context("fed", announce(blob=bytes(32)))
    assert a != round_context("fed", announce(attempt=1))
    assert a != round_context("other", announce())


def test_a_site_refuses_a_hostile_task(tmp_path) -> None:
    csv = tmp_path / "site.csv"
    csv.write_text("pid,a,b,label\n" + "".join(f"p{i},{i},{i % 3},{'yes' if i % 2 else 'no'}\n"
                                                for i in range(20)))
    data = SiteData(1, csv=str(csv), patient_column="pid", label_column="label")
    assert data.schema.features == ("a", "b") and data.schema.labels == ("no", "yes")
    good = {"features": ["a", "b"], "labels": ["no", "yes"], "model": "logreg",
            **RoundTask(mode="none", round=3, cohort=3, seed=0, batch_size=8).to_wire()}
    model = np.zeros(6)
    vector = site_input(data, Blob("train", good, model), announce(threshold=2), require_dp=None,
                        guard=site_core())
    assert vector.dtype == np.uint64 and vector.size == 7
    for bad in ({"features": ["a", "c"]}, {"labels": ["yes"]}, {"lr": float("nan")},
                {"mode": "magic"}, {"batch_size": 0}, {"local_epochs": True},
                {"round": 4}, {"cohort": 5}):
        with pytest.raises(WireError):
            site_input(data, Blob("train", {**good, **bad}, model), announce(threshold=2),
                       require_dp=None, guard=site_core())
    with pytest.raises(WireError, match="parameters"):
        site_input(data, Blob("train", good, np.zeros(5)), announce(threshold=2), require_dp=None,
                   guard=site_core())
    with pytest.raises(WireError, match="requires --dp distributed"):
        site_input(data, Blob("train", good, model), announce(threshold=2),
                   require_dp="distributed", guard=site_core())
