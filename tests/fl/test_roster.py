"""The federation roster each site operator holds (fl/site/identity.py, docs/privacy.md section 1).

The attack (attacker review, HIGH): the coordinator chooses the roster and relays the keys,
so alone it can fill a round with t-1 sites it simulates (zero inputs, keys it made); the
round then decodes to exactly one real site's vector, carrying only that site's share of
the noise. Here a hostile coordinator built from the library (``CoordinatorChannel``, the
real coordinator's federation link, answering Ready for its invented sites and running
their secagg clients) attacks a real :class:`fl.remote.site.SiteProcess`:

* without peer keys the attack works, and the site's ledger charges the round as what it
  is worth (the lone-share event, calibration threshold 1), not as calibrated;
* with the operator's peer keys the site refuses the invented sites by name (nothing
  charged), and sites it knows but whose private keys the coordinator lacks make the
  round abort before anything is decoded.

(The invented sites connect to the in-memory bus under their own names; a coordinator could
as well feed their messages to its server in-process: the site sees the same bytes.)
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dp.ledger import Ledger
from dp.policy import Proposal, SitePolicy
from fl.cli import main
from fl.contribution import round_task
from fl.federation import make_plan
from fl.models import make_model
from fl.remote.blob import Blob
from fl.remote.channel import CoordinatorChannel, NotEnoughSites, RemoteRound
from fl.remote.inputs import demo_site_data
from fl.remote.messages import Ready, decode_coordinator_message, round_context
from fl.remote.site import SiteOptions, SiteProcess
from fl.settings import TrainSettings
from fl.site.core import open_site_core
from fl.site.identity import (
    IdentityError,
    RosterRefused,
    SiteIdentity,
    check_roster,
    generate,
    load_peer_keys,
    load_signing_key,
)
from fl.vector import ParameterLayout
from secagg import Config, ProtocolAbort, SigningKey
from secagg.client import Client
from tests.pace import slowdown
from transport.deadlines import round_timeouts
from transport.errors import TransportError
from transport.framing import Reassembler
from transport.memory import MemoryNetwork
from transport.rounds import serve_client
from transport.topics import Topics

pytestmark = pytest.mark.timeout(120)
VICTIM = 1
SETTINGS = TrainSettings(sites=3, rounds=1, dataset="breast-cancer", seed=0,
                         dp="distributed", noise_multiplier=1.0, sample_rate=0.1)


# --------------------------------------------------------------------------- keys
def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: Path,
                                                          capsys: Any) -> None:
    key = tmp_path / "site-3.key"
    assert main(["keygen", "--out", str(key)]) == 0
    assert "fingerprint" in capsys.readouterr().out
    assert key.stat().st_mode & 0o777 == 0o600
    pub = tmp_path / "site-3.pub"
    signing = load_signing_key(key)
    assert load_peer_keys(tmp_path) == {3: signing.public}
    assert main(["keygen", "--out", str(key)]) == 2  # an identity is never overwritten
    assert "--force" in capsys.readouterr().err
    assert load_signing_key(key).public == signing.public
    key.chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_signing_key(key)
    pub.write_text("not a key")
    with pytest.raises(IdentityError, match="not a PEM public key"):
        load_peer_keys(tmp_path)


def test_a_peer_directory_that_cannot_back_a_roster_is_refused(tmp_path: Path) -> None:
    peers = tmp_path / "peers"
    peers.mkdir()
    with pytest.raises(IdentityError, match=r"no site-<id>\.pub"):
        load_peer_keys(peers)
    generate(peers / "site-1.key")
    generate(peers / "site-2.key")
    (peers / "site-1.key").rename(tmp_path / "site-1.key")
    own = SiteIdentity.load(1, tmp_path / "site-1.key", peers)
    assert sorted(own.peers) == [1, 2]
    with pytest.raises(IdentityError, match="not the public key of"):
        SiteIdentity.load(2, tmp_path / "site-1.key", peers)
    with pytest.raises(IdentityError, match=r"has no site-7\.pub"):
        SiteIdentity.load(7, tmp_path / "site-1.key", peers)
    (peers / "site-9.pub").write_bytes((peers / "site-2.pub").read_bytes())
    with pytest.raises(IdentityError, match=r"the same key as site-2\.pub"):
        load_peer_keys(peers)
    with pytest.raises(RosterRefused, match=r"\[peer_keys\].*\[101\]") as refused:
        check_roster((1, 2, 101), own.peers, min_sites=2)
    assert refused.value.rule == "peer_keys"
    with pytest.raises(RosterRefused, match=r"\[min_threshold\]"):
        check_roster((1, 2), own.peers, min_sites=3)


def test_the_cli_wants_the_key_and_the_peer_keys_together(tmp_path: Path,
                                                          capsys: Any) -> None:
    generate(tmp_path / "site-1.key")
    base = ["train", "--role", "site", "--site-id", "1", "--sites", "3",
            "--broker", "mqtt://site-1:pw@127.0.0.1:1"]
    assert main([*base, "--peer-keys", str(tmp_path)]) == 2
    assert "--signing-key and --peer-keys go together" in capsys.readouterr().err
    assert main(["train", "--role", "coordinator", "--sites", "3", "--rounds", "1",
                 "--broker", "mqtt://server:pw@127.0.0.1:1",
                 "--signing-key", str(tmp_path / "site-1.key")]) == 2
    assert "the coordinator needs only --peer-keys" in capsys.readouterr().err


def test_the_plan_with_peer_keys_is_that_of_the_authenticated_run(tmp_path: Path,
                                                                    capsys: Any) -> None:
    """Malicious mode needs more than 2/3 of the cohort: ``--plan`` calibrates the noise to
    the threshold the authenticated run uses (fl.settings.TrainSettings.secagg_threshold)."""
    import json

    for cid in (1, 2, 3):
        generate(tmp_path / f"site-{cid}.key")
    plan = ["train", "--role", "coordinator", "--sites", "1,2,3", "--rounds", "2", "--dp",
            "distributed", "--noise-multiplier", "1.0", "--plan", "--json"]
    out = {}
    for name, extra in (("open", []), ("keys", ["--peer-keys", str(tmp_path)])):
        assert main([*plan, *extra]) == 0
        out[name] = json.loads(capsys.readouterr().out)
    assert out["open"]["secagg_threshold"] == 2 and out["keys"]["secagg_threshold"] == 3
    assert out["keys"]["calibration_threshold"] == 3
    assert TrainSettings(sites=3, security="malicious").secagg_threshold == 3
    assert main(["train", "--sites", "3", "--rounds", "1", "--peer-keys",
                 str(tmp_path)]) == 2  # --role all simulates every site: no roster
    assert "--peer-keys is for --role coordinator and site" in capsys.readouterr().err


# --------------------------------------------------------------------------- the attack
def _federation_keys(tmp_path: Path) -> tuple[SiteIdentity, dict[int, bytes]]:
    """Sites 1..3 of the federation; the victim's operator holds all three public keys."""
    peers = tmp_path / "peers"
    peers.mkdir()
    for cid in (1, 2, 3):
        generate(peers / f"site-{cid}.key")
    (peers / "site-1.key").rename(tmp_path / "site-1.key")
    identity = SiteIdentity.load(VICTIM, tmp_path / "site-1.key", peers)
    return identity, dict(identity.peers)


def _round_blob() -> tuple[bytes, Any, int]:
    """The blob of a distributed-DP round exactly as the coordinator role builds it
    (fl.remote.coordinator.RemoteCoordinator.wire_task), and its task."""
    data = demo_site_data(SETTINGS, VICTIM, (1, 2, 3))
    model = make_model(SETTINGS.model, len(data.schema.features), len(data.schema.labels),
                       SETTINGS.seed)
    layout = ParameterLayout.of(model)
    plan = make_plan(SETTINGS, None, layout.size, 3, max_units=1000)
    task = round_task(SETTINGS, plan, 1, 3, max_units=1000)
    body = {"features": list(data.schema.features), "labels": list(data.schema.labels),
            "model": SETTINGS.model, **task.to_wire()}
    return Blob("train", body, layout.to_vector(model)).encode(), task, layout.size


async def _attack(network: MemoryNetwork, site: SiteProcess, invented: dict[int, SigningKey],
                  server_keys: dict[int, bytes] | None, logs: list[str]) -> RemoteRound:
    """The hostile coordinator: the round's cohort is the victim plus ``invented`` sites,
    for which it answers Ready itself and runs secagg clients with zero inputs."""
    blob, task, size = _round_blob()
    dim, cohort = task.encoded_dim(size), (VICTIM, *invented)
    # The victim's first round warms torch up in its thread: the waits follow the host
    # (tests/pace.py; at load average 12-16 a fixed 20 s ready wait once saw it not ready).
    pace = slowdown()
    site_task = asyncio.create_task(site.run())
    async with CoordinatorChannel(network, "fed", cohort, logs.append,
                                  verify_keys=server_keys) as channel:
        while VICTIM not in channel.hellos:  # the invented sites never say hello
            await asyncio.sleep(0.02)

        async def pretend() -> None:
            while channel._key is None:
                await asyncio.sleep(0.01)
            for cid in invented:
                channel.readies[cid] = Ready(*channel._key, channel._digest)
            while True:  # the go: run the invented sites' clients
                go = decode_coordinator_message(Reassembler(1 << 20).feed(
                    "c", network.retained[channel.topics.control], 0.0).payload)
                if getattr(go, "phase", "") == "go":
                    break
                await asyncio.sleep(0.01)
            config = Config(num_clients=len(go.roster), threshold=go.threshold, dim=dim,
                            bits=task.bits, security=go.security)
            await asyncio.gather(*(serve_client(network, Client(
                config, cid, np.zeros(dim, np.uint64), roster=go.roster,
                context=round_context("fed", go), signing_key=invented[cid],
                verify_keys=server_keys), Topics(go.name), timeouts=round_timeouts(10.0 * pace))
                for cid in invented if cid in go.roster))

        helper = asyncio.create_task(pretend())
        try:
            return await channel.run_round(
                kind="train", round_number=1, attempt=0, blob=blob, cohort=cohort,
                threshold=3, dim=dim, bits=task.bits, verify=True, ready_timeout=20 * pace,
                timeouts=round_timeouts(10.0 * pace))
        finally:
            helper.cancel()
            await channel.finish(1, "attack over")
            await asyncio.wait_for(site_task, 20)


def _victim(network: MemoryNetwork, tmp_path: Path, identity: SiteIdentity | None,
            logs: list[str]) -> SiteProcess:
    guard = open_site_core(policy=SitePolicy(modes=("distributed",), min_threshold=3,
                                             min_noise_multiplier=0.0, round_epsilon=None,
                                             epsilon=None),  # what is charged, no cap
                            ledger_path=str(tmp_path / "ledger.json"))
    options = SiteOptions(federation="fed", idle_timeout=30, stage_timeout=10.0,
                          guard=guard, identity=identity)
    return SiteProcess(demo_site_data(SETTINGS, VICTIM, (1, 2, 3)), network, options,
                       logs.append)


def _epsilon_of(params: Any, sample_rate: float, tmp_path: Path, name: str) -> float:
    with Ledger.open(tmp_path / name, SitePolicy(min_threshold=1, min_noise_multiplier=0.0,
                                                 epsilon=None, round_epsilon=None)) as ledger:
        proposal = Proposal.distributed(params, sample_rate=sample_rate, secagg_threshold=3)
        return ledger.charge(proposal).epsilon_after


def test_without_peer_keys_the_isolated_site_is_charged_what_the_leak_is_worth(
        tmp_path: Path) -> None:
    network, logs = MemoryNetwork(), []
    site = _victim(network, tmp_path, None, logs)
    invented = {101: SigningKey.generate(), 102: SigningKey.generate()}
    done = asyncio.run(_attack(network, site, invented, None, logs))
    # The attack works on a site without a roster: the invented sites summed zeros, so the
    # sum is the victim's vector alone.
    assert done.result.included == frozenset({VICTIM, 101, 102})
    assert np.any(done.result.total != 0)
    charges = list(site.options.guard.ledger.active())
    assert len(charges) == 1
    _, task, _ = _round_blob()
    lone = _epsilon_of(replace(task.params, threshold=1), task.sample_rate, tmp_path, "1")
    calibrated = _epsilon_of(task.params, task.sample_rate, tmp_path, "3")
    assert charges[0].epsilon_after == pytest.approx(lone, rel=1e-9)
    assert lone > 2 * calibrated  # what a coordinator-chosen roster would have charged


def test_with_peer_keys_the_site_refuses_invented_sites_and_nothing_is_charged(
        tmp_path: Path) -> None:
    identity, keys = _federation_keys(tmp_path)
    network, logs = MemoryNetwork(), []
    site = _victim(network, tmp_path, identity, logs)
    invented = {101: SigningKey.generate(), 102: SigningKey.generate()}
    server_keys = {VICTIM: keys[VICTIM], **{c: k.public for c, k in invented.items()}}
    with pytest.raises(NotEnoughSites):
        asyncio.run(_attack(network, site, invented, server_keys, logs))
    text = "\n".join(logs)
    assert "refused by site policy [peer_keys]" in text and "[101, 102]" in text
    assert "site 1 declined round 1" in text
    assert site.options.guard.ledger.charges == []  # refused before anything was charged


def test_with_peer_keys_a_semi_honest_round_is_declined(tmp_path: Path) -> None:
    """A coordinator without the sites' keys runs semi-honest rounds: nothing is signed, so
    the site cannot tell its peers from invented ones and declines before any charge."""
    identity, _ = _federation_keys(tmp_path)
    network, logs = MemoryNetwork(), []
    site = _victim(network, tmp_path, identity, logs)
    with pytest.raises(NotEnoughSites):
        asyncio.run(_attack(network, site, {2: SigningKey.generate(),
                                            3: SigningKey.generate()}, None, logs))
    assert "semi-honest mode; with --peer-keys this site takes part only in " in "\n".join(logs)
    assert site.options.guard.ledger.charges == []


def test_with_peer_keys_impersonated_peers_cannot_complete_the_round(tmp_path: Path) -> None:
    identity, keys = _federation_keys(tmp_path)
    network, logs = MemoryNetwork(), []
    site = _victim(network, tmp_path, identity, logs)
    # The coordinator names the real peers 2 and 3 but holds only keys it made itself.
    invented = {2: SigningKey.generate(), 3: SigningKey.generate()}
    server_keys = {VICTIM: keys[VICTIM], **{c: k.public for c, k in invented.items()}}
    with pytest.raises((ProtocolAbort, TransportError)):
        asyncio.run(_attack(network, site, invented, server_keys, logs))
    text = "\n".join(logs)
    assert "round 1: aborted" in text and "signature" in text, text
    # Authenticated, the round was charged as calibrated (threshold 3, not the lone share),
    # and withdrawn: the site aborted before its masked input existed, so a coordinator
    # cannot drain a site's budget with rounds it cannot complete.
    _, task, _ = _round_blob()
    [charge] = site.options.guard.ledger.charges
    assert charge.epsilon_after == pytest.approx(
        _epsilon_of(task.params, task.sample_rate, tmp_path, "3"), rel=1e-9)
    assert "before this site's masked input existed" in (charge.withdrawn or "")
    assert site.options.guard.ledger.releases == 0


# --------------------------------------------------------------------------- processes
@pytest.mark.timeout(300)  # 12 s alone, 51 s measured on a 2-core machine at load average 7
def test_sites_and_coordinator_with_peer_keys_train_across_processes(tmp_path: Path) -> None:
    """``secagg keygen`` per site, one shared directory of public keys: every party its own
    process on the password-and-ACL broker, every round authenticated (malicious mode)."""
    import json

    from test_multiprocess_training import (
        COMMON,
        READY_TIMEOUT,
        SITES,
        Party,
        federation_broker,
    )

    from transport.topics import SERVER_USER, site_name

    peers = tmp_path / "peers"
    peers.mkdir()
    for cid in SITES:
        assert main(["keygen", "--out", str(tmp_path / f"site-{cid}.key"), "-q"]) == 0
        (tmp_path / f"site-{cid}.pub").rename(peers / f"site-{cid}.pub")
    report = tmp_path / "report.json"
    with federation_broker() as urls:
        coordinator = Party(["--role", "coordinator", "--sites", "1,2,3", "--rounds", "1",
                             "--dp", "none", "--broker", urls[SERVER_USER], "--report",
                             str(report), "--join-timeout", "60", "--ready-timeout", READY_TIMEOUT,
                             "--insecure-verify", "--peer-keys", str(peers), *COMMON])
        sites = {cid: Party(["--role", "site", "--site-id", str(cid), "--sites", "3",
                             "--broker", urls[site_name(cid)], "--idle-timeout", "60",
                             "--insecure-verify", "--ledger", str(tmp_path / f"l{cid}.json"),
                             "--dp", "none",  # an exact (no-DP) run: the operators' opt-in
                             "--signing-key", str(tmp_path / f"site-{cid}.key"),
                             "--peer-keys", str(peers), *COMMON]) for cid in SITES}
        try:
            assert coordinator.wait(240) == 0, coordinator.log
            for party in sites.values():
                assert party.wait(20) == 0, party.log
                assert "rounds run authenticated (secagg malicious mode)" in party.log
                assert "round 1: done" in party.log, party.log
        finally:
            for party in (coordinator, *sites.values()):
                party.kill()
    rows = json.loads(report.read_text())["rounds"]
    assert [row["round"] for row in rows] == [1]
    assert rows[0]["included"] == [1, 2, 3] and rows[0]["aggregate_correct"] is True
    assert "threshold 3" in coordinator.log  # malicious mode: more than 2/3 of 3 sites
