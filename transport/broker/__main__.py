"""``python -m transport.broker`` (see ``transport.broker.cli``)."""

from transport.broker.cli import main

raise SystemExit(main())
