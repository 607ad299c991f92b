"""What a hospital runs, in one place: its local training (``training``: ``Site``,
``Scaler``), and its privacy guarantees, which every runtime (the ``secagg train`` site
role, the Flower node, NVFlare) wraps thinly: ``core`` (``SiteCore``: the operator's policy,
the write-ahead ledger, the per-mode encoding and the protocol client), ``privacy`` (the
per-mode plans), ``idp`` (patient-level individual privacy assignment), ``private_scaler``
(feature scaling from private sums) and ``identity`` (the site's long-term key).

Importing ``fl.site`` imports nothing; ``fl.site.core`` and ``fl.site.identity`` need no
torch (the Flower adapter runs without it), ``training`` and ``idp`` do.
"""
