"""The federation's plan: the planning half of privacy, the coordinator's side of every
release (docs/architecture.md, the folder map). What a site runs is ``fl.site``; nothing
there imports this package or the coordinator, not even to annotate
(``tests/test_layout.py``).

* ``privacy``: the run's privacy plan and its rounds' plans (``NoPrivacy``, ``SiteDpPlan``,
  ``DistributedPlan``; ``site_plan``, ``distributed_plan``), the federation's budget
  (``make_budget``, ``restore_budget``), the plan report (``schedule``, ``mechanism_of``)
  and the audit trail's lines (``release_record``). The one module of this package the
  round's task (``fl.contribution``), which sites run too, reads (and ``fl.round_plan``):
  :data:`SHARED_WITH_SITES`.
* ``scaler``: the noised feature statistics' plan, its share of the budget and its charge,
  and the decoding of their noised sum (a site's input: ``fl.site.private_scaler``).
* ``weights``: the site weights' release plan and the weights from the releases alone (a
  site's release: ``fl.site.weights``).
* ``idp``: ``--unit patient-idp`` at the coordinator: the budget over every site's rate
  groups, its restore on ``--resume``, the report and the plan summary (a site's own groups,
  plan and ledger: ``fl.site.idp``).

Importing ``fl.plan`` imports nothing; import a module (``from fl.plan import scaler``,
``from fl.plan.privacy import DistributedPlan``).
"""

#: The modules of this package that code a site runs may load (through the round's task),
#: all others being the coordinator's only (``tests/test_layout.py`` holds fl/site/ to it).
SHARED_WITH_SITES = frozenset({"fl.plan.privacy"})

__all__ = ["SHARED_WITH_SITES", "idp", "privacy", "scaler", "weights"]
