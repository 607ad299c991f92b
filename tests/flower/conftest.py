"""The Flower adapter's tests need the ``flower`` extra; a core install skips them."""

import pytest

pytest.importorskip("flwr", reason="the Flower adapter tests need: pip install 'secagg[flower]'")
