"""The op table on cuda (marked ``cuda``; skipped without a GPU, run by ``scripts/device-check.sh``).

Every (row, dtype, case) of tests/op_table.py and tests/op_table_llm.py is made on the CPU, moved to the GPU and run
through ``dtorch.ops.invoke`` on the cuda key, once with the winner and once per cuda candidate alone (the Triton
kernels, the torch kernels registered for cuda), then compared with the row's torch reference computed on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.core.device import Device
from dtorch.core.dtypes import dtype_name
from dtorch.dispatch.context import KernelParams
from dtorch.dispatch.key import KernelKey
from dtorch.dispatch.meta import Call
from tests.op_table import ROWS
from tests.op_table_llm import LLM_ROWS

if not torch.cuda.is_available():  # one skip for the module, not one per case
    pytest.skip("needs a CUDA device (run by scripts/device-check.sh)", allow_module_level=True)
pytestmark = pytest.mark.cuda

CASES = [pytest.param(row, dt, case, id=f"{row.id}-{dtype_name(dt)}-{case}")
         for row in ROWS + LLM_ROWS for dt in row.dtypes for case in row.cases]


def _cuda(x):
    return x.cuda() if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize(("row", "dtype", "case"), CASES)
def test_row_on_cuda(row, dtype, case):
    inputs = row.make_inputs(dtype, case)
    params = row.params_for(dtype, case)
    want = row.reference(inputs, params)
    dev = [_cuda(t) for t in inputs]
    first = next((t for t in dev if isinstance(t, torch.Tensor)), None)
    key = KernelKey(row.op, "cuda", first.dtype if first is not None else want.dtype)
    cands = dtorch.dispatcher.candidates(key)
    if not cands:
        pytest.skip(f"{key}: nothing registered for cuda")
    call = Call(Device("cuda"), key.dtype, KernelParams(**params), dev)
    for provider in [None, *(c.provider for c in cands)]:
        if provider is not None:
            cand = next(c for c in cands if c.provider == provider)
            if cand.check is not None and cand.check(call) is not None:
                continue  # declines this call (head dim, dtype, ...): the winner above served it
        others = {c.provider for c in cands} - {provider} if provider else set()
        with dtorch.dispatcher.disabled(*others):
            out = torch.empty(want.shape, dtype=want.dtype, device="cuda")
            dtorch.ops.invoke(row.op, dev, [out], params)
        if not row.values:
            continue
        rtol, atol = row.tolerance(dtype)
        torch.testing.assert_close(out.cpu(), want, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, p=provider: f"{row.id} on cuda ({p or 'winner'}): {m}")
