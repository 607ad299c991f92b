"""The MQTT topic layout of a secagg round, designed so a broker ACL confines each site.

Every topic of a round lives under ``secagg/<round>/`` where ``<round>`` is a short name
the coordinator picks per round (letters, digits, ``-``, ``_``). Sites authenticate as
``site-<id>`` and the aggregator as ``server``::

    secagg/<round>/server/<kind>/site-<id>   site -> server: one stage message per stage
                                             (<kind> = stage label), plus "offline" (the
                                             last will, or a site signing off) and "abort"
    secagg/<round>/client/site-<id>/<kind>   server -> site: the stage messages addressed to
                                             it (<kind> = stage label) and "receipt"s
    secagg/<round>/control                   server -> everyone: start (retained), end,
                                             abort

With Mosquitto's ``%u`` substitution the whole policy is four lines (docs/deployment.md)::

    pattern write secagg/+/server/+/%u
    pattern read  secagg/+/client/%u/#
    pattern read  secagg/+/control
    user server / topic readwrite secagg/#

So a site can only speak as itself and only hear its own messages; the server learns who
sent a message from the topic (which the ACL authenticates), never from the payload, and the
state machine additionally checks the payload's client id against it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from secagg import Stage

from .broker.topics import SERVER_USER as SERVER_USER  # defined with the broker
from .broker.topics import TopicAcl

ROOT = "secagg"
SITE_PREFIX = "site-"
OFFLINE = "offline"
ABORT = "abort"
RECEIPT = "receipt"
CONTROL = "control"

_ROUND_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STAGE_LABELS = {stage.label: stage for stage in Stage}


def check_round_name(name: str) -> str:
    """Validate a round name (one topic level); returns it."""
    if not isinstance(name, str) or not _ROUND_NAME.match(name):
        raise ValueError(f"round name {name!r}: use 1-64 letters, digits, '-' or '_' (it "
                         "becomes one MQTT topic level)")
    return name


def site_name(client_id: int) -> str:
    """The username and topic level of a site: ``site-<id>``."""
    return f"{SITE_PREFIX}{client_id}"


def parse_site(level: str) -> int | None:
    """``"site-7"`` -> 7; None for anything that is not a canonical site name."""
    if not level.startswith(SITE_PREFIX):
        return None
    digits = level[len(SITE_PREFIX):]
    if not digits.isdigit() or (len(digits) > 1 and digits[0] == "0") or len(digits) > 10:
        return None
    value = int(digits)
    return value if value < (1 << 32) else None


def stage_of(kind: str) -> Stage | None:
    """The stage a topic's ``<kind>`` level names, or None for control kinds."""
    return _STAGE_LABELS.get(kind)


@dataclass(frozen=True)
class Topics:
    """Topic names and filters of one round."""

    round_name: str

    def __post_init__(self) -> None:
        check_round_name(self.round_name)

    @property
    def base(self) -> str:
        return f"{ROOT}/{self.round_name}"

    # site -> server
    def upstream(self, client_id: int, kind: str) -> str:
        return f"{self.base}/server/{kind}/{site_name(client_id)}"

    def stage_upstream(self, client_id: int, stage: Stage) -> str:
        return self.upstream(client_id, stage.label)

    def offline(self, client_id: int) -> str:
        """Where a site's last will goes (and where it signs off)."""
        return self.upstream(client_id, OFFLINE)

    @property
    def server_filter(self) -> str:
        return f"{self.base}/server/#"

    # server -> site
    def downstream(self, client_id: int, kind: str) -> str:
        return f"{self.base}/client/{site_name(client_id)}/{kind}"

    def client_filter(self, client_id: int) -> str:
        return f"{self.base}/client/{site_name(client_id)}/#"

    @property
    def control(self) -> str:
        return f"{self.base}/{CONTROL}"

    # parsing
    def parse_upstream(self, topic: str) -> tuple[str, int] | None:
        """``secagg/<round>/server/<kind>/site-<id>`` -> (kind, id); None otherwise."""
        parts = topic.split("/")
        if (len(parts) != 5 or parts[0] != ROOT or parts[1] != self.round_name
                or parts[2] != "server"):
            return None
        cid = parse_site(parts[4])
        return None if cid is None else (parts[3], cid)

    def parse_downstream(self, topic: str) -> tuple[int, str] | None:
        """``secagg/<round>/client/site-<id>/<kind>`` -> (id, kind); None otherwise."""
        parts = topic.split("/")
        if (len(parts) != 5 or parts[0] != ROOT or parts[1] != self.round_name
                or parts[2] != "client"):
            return None
        cid = parse_site(parts[3])
        return None if cid is None else (cid, parts[4])


def site_acl(username: str) -> TopicAcl:
    """A site: reads its own downstream topics and the control topics, writes only topics
    ending in its own name (``%u`` = its username), retains nothing."""
    del username  # the patterns use %u, expanded by the broker
    return TopicAcl(subscribe=(f"{ROOT}/+/client/%u/#", f"{ROOT}/+/{CONTROL}"),
                    publish=(f"{ROOT}/+/server/+/%u",))


def server_acl() -> TopicAcl:
    """The aggregator: reads every upstream topic, writes downstream and control topics, and
    retains only on control topics (the round start and end, the federation's state)."""
    return TopicAcl(subscribe=(f"{ROOT}/+/server/#",),
                    publish=(f"{ROOT}/+/client/#", f"{ROOT}/+/{CONTROL}"),
                    retain=(f"{ROOT}/+/{CONTROL}",))


def acl_table(client_ids: list[int] | tuple[int, ...]) -> dict[str, TopicAcl]:
    """username -> ``TopicAcl`` for the server and every site; what the brokers take."""
    table = {SERVER_USER: server_acl()}
    for cid in client_ids:
        table[site_name(cid)] = site_acl(site_name(cid))
    return table


def acl_json(client_ids: list[int] | tuple[int, ...]) -> dict[str, dict[str, list[str]]]:
    """``acl_table`` as the embedded broker's ``--acl-file`` holds it (``json.dump`` takes
    it as is)."""
    return {user: entry.to_json() for user, entry in acl_table(client_ids).items()}
