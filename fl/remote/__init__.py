"""Training across machines: one coordinator process, one process per hospital site.

``secagg train --role all`` (the default) simulates every site in the coordinator's
process. Here each party is its own process with its own MQTT identity and exactly one
connection (:mod:`fl.remote.link`), and a site's records never leave its process: it
receives the global model, computes its input with the simulation's own code
(:func:`fl.contribution.site_input`), and hands only the encoded vector to secure
aggregation (``transport.drivers``).

One training round (the messages are in :mod:`fl.remote.messages`)::

    coordinator (fl.remote.coordinator)           site k (fl.remote.site), in the cohort
    Announce(open, cohort, blob sha256) ------->  (retained)
    Blob (task, model, scaler), chunked ------->  verify sha256, compute its input
                                          <-----  Fetch, only when none of it arrives
    the blob again, to that site alone ------->
                                          <-----  Ready
    (every cohort site ready or offline, or --ready-timeout)
    Announce(go, roster = ready sites) -------->  Client(roster, context = f(blob sha256))
    ServerDriver  <==== secure aggregation ====>  ClientDriver
    decode, average, evaluate, checkpoint

Dropouts: a site that is offline (its last will) is not waited for; one that dies during
the secagg round is dropped by its will or the stage deadline, and the round completes when
at least ``threshold`` sites remain (else it is retried, spending nothing). The threshold
is that of the full cohort, so the distributed-DP noise, calibrated to it, never falls
below target however many sites are missing.

Modules: :mod:`~fl.remote.messages` (federation messages and topics), :mod:`~fl.remote.blob`
(the round's blob), :mod:`~fl.remote.link` (one connection per party, demultiplexed),
:mod:`~fl.remote.inputs` (a site's data and input), :mod:`~fl.remote.site` (the site role),
:mod:`~fl.remote.channel` (the coordinator's federation link),
:mod:`~fl.remote.coordinator` (the coordinator role).
"""
