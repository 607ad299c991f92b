"""asyncio drivers that bind the sans-IO ``secagg.Server`` and ``secagg.Client`` to a bus.

The state machines decide; the drivers own time and the wire (docs/architecture.md section 5):

* every payload is framed (``transport.framing``): chunked above ``max_payload``, reassembled
  in bounded buffers; garbage, truncated, oversized and spliced payloads are logged and
  dropped, never handed to a state machine;
* the server learns a sender from the topic (which the broker's ACL authenticates) and the
  state machine checks the payload's own client id against it;
* delivery is confirmed at the protocol level: the server answers every client message with
  a ``Receipt`` (sha256 of the message, accepted or why not) and its next-stage message is
  the client's real confirmation. A client re-publishes a message that got no receipt after
  ``retry`` seconds, and re-publishes it again when no next message came for ``answer``
  seconds; the server treats an identical message as a duplicate and re-sends its answer;
* each stage closes when every expected client answered, is known to be gone (its sign-off
  arrived, or its last will and then ``will_grace`` seconds without the server's own
  connection failing: a broker that shuts down publishes every will), or the stage deadline
  passed;
* duplicates are harmless everywhere: the same message id is the same bytes.

This module holds what both sides share (deadlines, framed publishing, wills, progress);
the sides are :mod:`transport.server_driver` (``ServerDriver``) and
:mod:`transport.client_driver` (``ClientDriver``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from secagg import Stage
from secagg.server import Server

from .control import (
    Offline,
    encode_control,
)
from .errors import TransportError
from .framing import (
    HEADER_BYTES,
    frame,
)
from .link import Link, Will
from .topics import Topics

DEFAULT_CHUNK_BYTES = 4 << 20
"""Bytes of masked vector per streamed chunk (``MaskedChunk``): the window a client masks
and the server reassembles at a time."""
DEFAULT_UPLOAD_WINDOW = 4
"""Chunks a granted client may have unconfirmed (each chunk's receipt frees one)."""
UPLOAD_IDLE_SHARE = 0.25
"""The default ``Timeouts.upload_idle``, as a share of the masked_input deadline: a granted
site that goes silent costs the sites waiting for its slot at most a quarter of the stage.
An honest sender is never idle that long: it re-publishes an unconfirmed chunk every
``retry`` seconds."""
PUBLISH_AHEAD = 16
"""Frames of one message ``publish_framed`` has in flight at once (below paho's default
of 20 unacknowledged QoS 1 messages per connection)."""


@dataclass(frozen=True)
class Timeouts:
    """Seconds. ``stage``: a stage's deadline after it opens (``per_stage`` overrides by stage
    label); ``start``: how long a client waits for the round start; ``retry``: re-publish a
    message without receipt; ``answer``: re-publish a confirmed message when the next one does
    not come; ``give_up``: a client abandons the round after this long without progress;
    ``resend_interval``: the server re-sends an answer to one client at most this often;
    ``will_grace``: how long a last will must stand before the server stops waiting;
    ``upload_idle``: the server takes back the upload slot of a sender whose streamed
    masked input brought no chunk for this long (docs/deployment.md, flow control);
    ``None``: ``UPLOAD_IDLE_SHARE`` of the masked_input deadline (``upload_idle_limit``).
    It must be below that deadline (``TimeoutsError`` otherwise): a slot holder that
    fails must give its slot back while the other sites can still stream."""

    stage: float = 60.0
    per_stage: Mapping[str, float] = field(default_factory=dict)
    start: float = 120.0
    retry: float = 5.0
    answer: float = 30.0
    give_up: float = 300.0
    resend_interval: float = 1.0
    will_grace: float = 0.5
    upload_idle: float | None = None

    def __post_init__(self) -> None:
        deadline = self.deadline(Stage.MASKED_INPUT)
        if self.upload_idle is not None and not 0 < self.upload_idle < deadline:
            raise TimeoutsError(f"Timeouts.upload_idle = {self.upload_idle:g} s must be "
                                f"above 0 and below the masked_input deadline "
                                f"({deadline:g} s); leave it None for "
                                f"{UPLOAD_IDLE_SHARE:g} x that deadline")

    def deadline(self, stage: Stage) -> float:
        return float(self.per_stage.get(stage.label, self.stage))

    def upload_idle_limit(self) -> float:
        """Seconds without a chunk after which a sender loses its upload slot."""
        if self.upload_idle is not None:
            return self.upload_idle
        return UPLOAD_IDLE_SHARE * self.deadline(Stage.MASKED_INPUT)


class TimeoutsError(TransportError, ValueError):
    """A ``Timeouts`` the drivers cannot run a round with (says which field to change)."""


async def publish_framed(link: Link, topic: str, message: bytes, max_payload: int, *,
                         retain: bool = False, digest: bytes | None = None) -> int:
    """Publish ``message`` as frames; returns the bytes put on the wire (0 if the link
    refused any frame)."""
    # A retained message must be one frame (a topic retains one payload); control messages
    # are O(1) in size (no roster, no vectors), far below any broker's limit.
    frames = frame(message, max(max_payload, len(message) + HEADER_BYTES) if retain
                   else max_payload, digest)
    sent = 0
    # up to PUBLISH_AHEAD frames in flight at once (issued in order; MQTT keeps the order
    # of one connection): a chunked message waits for one round of PUBACKs per group, not
    # one per frame (5 x 10^8 elements at 256 KiB frames: 7,600 round trips otherwise)
    for start in range(0, len(frames), PUBLISH_AHEAD):
        group = frames[start:start + PUBLISH_AHEAD]
        if len(group) == 1:
            done = [await link.publish(topic, group[0], retain=retain)]
        else:
            done = await asyncio.gather(*(link.publish(topic, data, retain=retain)
                                          for data in group))
        if not all(done):
            return 0
        sent += sum(len(data) for data in group)
    return sent


def server_will(server: Server, topics: Topics) -> Will:
    """The server's last will: clients learn at once that the aggregator may be gone (and
    give up after ``Timeouts.answer`` seconds unless it comes back: a broker that shuts down
    publishes every will, the server's too)."""
    del server
    payload = encode_control(Offline("the aggregation server disconnected", final=False))
    return Will(topics.control, frame(payload)[0])


def client_will(topics: Topics, client_id: int) -> Will:
    """A site's last will: the server stops waiting for it before the stage deadline."""
    payload = encode_control(Offline("connection lost", final=False))
    return Will(topics.offline(client_id), frame(payload)[0])


@dataclass(frozen=True)
class StageProgress:
    """What the server driver reports when a stage closes (for progress displays)."""

    stage: Stage
    seconds: float
    responded: int
    expected: int
    gone: int
    deadline_hit: bool
