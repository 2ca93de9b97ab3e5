"""Op-table rows for the ``llm.*`` ops, appended by the engineers who write those kernels.

Each entry is a ``tests.op_table.Row``; ``tests/test_op_table.py`` imports ``LLM_ROWS`` and runs every row
through the functional wrapper, ``dtorch.ops.invoke`` and the reference-only provider, exactly like the
generic rows. Append rows here; do not edit the runner.
"""

LLM_ROWS: list = []
