"""What a hospital runs, in one place: its local training (``training``: ``Site``,
``Scaler``), and its privacy guarantees, which every runtime (the ``secagg train`` site
role, the Flower node, NVFlare) wraps thinly: ``core`` (``SiteCore``: the operator's policy,
the write-ahead ledger, the per-mode encoding and the protocol client), ``session`` (the
join sequence of a runtime's round), ``idp`` (a site's own patient-level rate groups, plan and
ledger), ``private_scaler`` (its input to the noised feature statistics), ``weights`` (its
release for the site weights) and ``identity`` (the site's long-term key). The federation's
plan (the privacy plan, budgets, the coordinator's side of each release) is ``fl.plan``;
nothing here imports it or the coordinator (``tests/test_layout.py``).

Importing ``fl.site`` imports nothing; ``fl.site.core`` and ``fl.site.identity`` need no
torch (the Flower adapter runs without it), ``training`` and ``idp`` do.
"""
