"""Privacy: distributed integer noise, accountants, budgets, patient-level grouping, Opacus glue.

May import ``secagg`` (encoding), never ``fl``.
"""
