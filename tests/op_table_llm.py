"""Op-table rows for the ``llm.*`` ops, appended by the engineers who write those kernels.

Each entry is a ``tests.op_table.Row``; ``tests/test_op_table.py`` imports ``LLM_ROWS`` and runs every row
through the functional wrapper, ``dtorch.ops.invoke`` and the reference-only provider, exactly like the
generic rows. Append rows here; do not edit the runner.
"""

LLM_ROWS: list = []

# llm.* ops that do not fit a Row (several outputs, optional None inputs, in-place state, host-read offsets),
# with where they are tested instead. tests/test_op_table.py should list these in its NOT_IN_TABLE.
NOT_IN_TABLE_LLM: dict[str, str] = {
    "llm.gated_delta_net": "two outputs (o, final state), optional initial_state/cu_seqlens inputs, two providers; "
                           "tested in tests/test_gated_delta_net.py against a per-step recurrence and transformers",
    "llm.causal_conv1d": "optional bias/initial_states inputs and an optional second output (final states); "
                         "tested in tests/test_causal_conv1d.py against torch conv1d",
    "llm.causal_conv1d_update": "updates conv_state in place (output 1 is read and written); tested step by step "
                                "against the full form in tests/test_causal_conv1d.py",
}
