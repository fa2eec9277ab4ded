"""The ground floor: the hot path's raw SQL (`sql`) and the helpers that read stored values back (`mapping`, the
declarative compensation args and expectations; `received`, arguments as the agent wrote them). They import nothing
of the ledger, so every other part may use them (tests/test_layers.py keeps imports running down its floors)."""
