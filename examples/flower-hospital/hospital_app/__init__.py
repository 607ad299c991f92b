"""A Flower app whose train rounds are securely aggregated by secagg."""
