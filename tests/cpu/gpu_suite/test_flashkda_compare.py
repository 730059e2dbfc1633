"""CPU tests of tests/gpu/flashkda_compare.py (issue #41's FlashKDA proof), no GPU needed.

The float64 KDA reference it holds FlashKDA and Triton to is checked here against computations
written independently of it: the chunked (WY) form of the same recurrence that the GPU kernels
use, solved with a triangular solve, and closed forms for one step and for a decay-only sequence
in plain Python. Then the parts that judge and record a GPU run: the inputs' layout, error
statistics, tolerances, the table, the result file, the JUnit counts of FlashKDA's own test and
the pin it names. Torch is the test venv's CPU build.
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.cpu.conftest import pins_lock

ROOT = Path(__file__).absolute().parents[3]
SCRIPT = ROOT / "tests" / "gpu" / "flashkda_compare.py"


def _load():
    spec = importlib.util.spec_from_file_location("flashkda_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashkda_compare"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fc = _load()
F64 = torch.float64


def _random_problem(lengths, heads, k_dim, v_dim, seed=0, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    return dict(
        q=torch.randn(tokens, heads, k_dim, generator=gen, dtype=F64),
        k=torch.randn(tokens, heads, k_dim, generator=gen, dtype=F64),
        v=torch.randn(tokens, heads, v_dim, generator=gen, dtype=F64),
        a=torch.randn(tokens, heads, k_dim, generator=gen, dtype=F64),
        b=torch.randn(tokens, heads, generator=gen, dtype=F64),
        A_log=torch.rand(heads, generator=gen, dtype=F64),
        dt_bias=torch.randn(heads * k_dim, generator=gen, dtype=F64),
        lower_bound=lower_bound,
        initial_state=torch.randn(len(lengths), heads, v_dim, k_dim, generator=gen, dtype=F64),
        lengths=tuple(lengths),
    )


def chunked_kda(q, k, v, a, b, A_log, dt_bias, lower_bound, initial_state, lengths, chunk):
    """The same KDA recurrence in chunked (WY) form, as the chunk kernels compute it, in float64.

    Within a chunk starting from state S0, with G_i the running sum of the log decays g and k, q
    normalized: S_i = S0 diag(exp(G_i)) + sum_{j<=i} u_j (k_j * exp(G_i - G_j))^T, where the
    pseudo-values u solve the unit lower-triangular system
        u_i + beta_i sum_{j<i} A_ij u_j = beta_i (v_i - S0 (k_i * exp(G_i))),
        A_ij = sum_c k_ic exp(G_ic - G_jc) k_jc,
    then o_i = S0 (q_i * exp(G_i)) + sum_{j<=i} [(q_i * exp(G_i - G_j)) . k_j] u_j and the chunk
    ends in S0 diag(exp(G_C)) + sum_j u_j (k_j * exp(G_C - G_j))^T."""
    heads, k_dim = q.shape[1], q.shape[2]
    g = lower_bound * torch.sigmoid(torch.exp(A_log.view(heads, 1)) * (a + dt_bias.view(heads, k_dim)))
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * k_dim ** -0.5
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(b)
    out = torch.zeros(v.shape, dtype=F64)
    final = torch.zeros(initial_state.shape, dtype=F64)
    start = 0
    for n, length in enumerate(lengths):
        state = initial_state[n].clone()
        for s in range(start, start + length, chunk):
            e = min(s + chunk, start + length)
            size = e - s
            strict = torch.ones(size, size, dtype=torch.bool).tril(-1)
            lower = torch.ones(size, size, dtype=torch.bool).tril()
            for h in range(heads):
                G = g[s:e, h].cumsum(0)  # [C, K]
                gap = G[:, None, :] - G[None, :, :]  # G_i - G_j
                # only j <= i is used: mask before exp, where the gap is positive and may overflow
                w_lower = torch.where(lower[..., None], gap, torch.tensor(-math.inf, dtype=F64)).exp()
                A = torch.einsum("ic,ijc,jc->ij", kn[s:e, h], w_lower, kn[s:e, h]) * strict
                Mq = torch.einsum("ic,ijc,jc->ij", qn[s:e, h], w_lower, kn[s:e, h])
                S0 = state[h]  # [V, K]
                rhs = beta[s:e, h, None] * (v[s:e, h] - (kn[s:e, h] * G.exp()) @ S0.T)
                system = torch.eye(size, dtype=F64) + beta[s:e, h, None] * A
                U = torch.linalg.solve_triangular(system, rhs, upper=False)
                out[s:e, h] = (qn[s:e, h] * G.exp()) @ S0.T + Mq @ U
                state[h] = S0 * G[-1].exp()[None, :] + U.T @ (kn[s:e, h] * (G[-1][None, :] - G).exp())
        final[n] = state
        start += length
    return out, final


def test_reference_matches_the_chunked_form() -> None:
    # V != K catches a transposed state; lengths that chunk 4 does not divide, two sequences.
    p = _random_problem(lengths=(7, 6, 1), heads=2, k_dim=4, v_dim=3, seed=1)
    out, final = fc.reference_kda(**p)
    for chunk in (1, 4, 16):
        c_out, c_final = chunked_kda(**p, chunk=chunk)
        assert torch.allclose(out, c_out, rtol=1e-10, atol=1e-12), (chunk, (out - c_out).abs().max())
        assert torch.allclose(final, c_final, rtol=1e-10, atol=1e-12), (chunk, (final - c_final).abs().max())


def test_reference_one_step_closed_form() -> None:
    """One token from a given state, in plain Python: S1 = S0 D + beta (v - S0 D k) k^T, o = S1 q."""
    q, k, v = [0.3, -1.2], [2.0, 0.5], [1.5, -0.25]
    a, b, A_log, dt_bias, lb = [0.7, -2.0], 0.4, 0.2, [0.1, -0.3], -5.0
    S0 = [[0.5, -1.0], [0.25, 2.0]]  # [V][K]
    nq = math.sqrt(sum(x * x for x in q) + 1e-6)
    nk = math.sqrt(sum(x * x for x in k) + 1e-6)
    qh = [x / nq * 2 ** -0.5 for x in q]
    kh = [x / nk for x in k]
    decay = [math.exp(lb / (1 + math.exp(-math.exp(A_log) * (a[c] + dt_bias[c])))) for c in range(2)]
    beta = 1 / (1 + math.exp(-b))
    SD = [[S0[r][c] * decay[c] for c in range(2)] for r in range(2)]
    resid = [v[r] - sum(SD[r][c] * kh[c] for c in range(2)) for r in range(2)]
    S1 = [[SD[r][c] + beta * resid[r] * kh[c] for c in range(2)] for r in range(2)]
    o = [sum(S1[r][c] * qh[c] for c in range(2)) for r in range(2)]

    t = lambda x: torch.tensor(x, dtype=F64)  # noqa: E731
    out, final = fc.reference_kda(t([[q]]), t([[k]]), t([[v]]), t([[a]]), t([[b]]), t([A_log]), t(dt_bias),
                                  lb, t([[S0]]), (1,))
    assert torch.allclose(out[0, 0], t(o), rtol=1e-13, atol=0)
    assert torch.allclose(final[0, 0], t(S1), rtol=1e-13, atol=0)


def test_reference_with_beta_zero_only_decays() -> None:
    """beta = sigmoid(-1000) = 0: S_t = S0 diag(exp(g_1 + ... + g_t)), o_t = S_t q_t."""
    p = _random_problem(lengths=(5,), heads=2, k_dim=3, v_dim=2, seed=2)
    p["b"] = torch.full_like(p["b"], -1000.0)
    out, final = fc.reference_kda(**p)
    g = fc.safe_gate(p["a"], p["A_log"], p["dt_bias"], p["lower_bound"])
    qn = fc.l2_normalize(p["q"]) * 3 ** -0.5
    for t in range(5):
        S_t = p["initial_state"][0] * g[: t + 1].sum(0).exp()[:, None, :]
        assert torch.allclose(out[t], (S_t @ qn[t][..., None])[..., 0], rtol=1e-12, atol=1e-14)
    assert torch.allclose(final[0], p["initial_state"][0] * g.sum(0).exp()[:, None, :], rtol=1e-12)


def test_safe_gate_is_the_bounded_log_decay() -> None:
    a = torch.tensor([[[0.0, 50.0, -50.0]]], dtype=F64)  # [T=1, H=1, K=3]
    g = fc.safe_gate(a, torch.tensor([0.0]), torch.zeros(3), -5.0)
    assert g[0, 0].tolist() == pytest.approx([-2.5, -5.0, 0.0], abs=1e-12)


def test_inputs_have_sglangs_layout() -> None:
    case = fc.Case("h2_varlen2_zeros", 2, (3, 5), "zeros")
    x = fc.make_inputs(case, seed=7, device="cpu")
    assert x.q.shape == x.k.shape == x.v.shape == x.g.shape == (1, 8, 2, fc.HEAD_DIM)
    # views of the packed post-conv qkv, as forward_extend splits it
    assert not x.v.is_contiguous() and x.q.untyped_storage().data_ptr() == x.v.untyped_storage().data_ptr()
    assert {t.dtype for t in (x.q, x.k, x.v, x.g, x.beta)} == {torch.bfloat16}
    assert x.beta.shape == (1, 8, 2)
    assert x.A_log.shape == (1, 1, 2, 1) and x.A_log.dtype == torch.float32
    assert x.dt_bias.shape == (2 * fc.HEAD_DIM,) and x.dt_bias.dtype == torch.float32
    assert x.pool.shape == (4, 2, fc.HEAD_DIM, fc.HEAD_DIM) and x.pool.dtype == torch.float32
    assert x.cache_indices.tolist() == [1, 2] and x.cache_indices.dtype == torch.int32
    assert x.query_start_loc.tolist() == [0, 3, 8] and x.query_start_loc.dtype == torch.int32
    assert x.pool[1:3].abs().max() == 0 and x.pool[0].abs().max() > 0  # only the batch's slots zeroed
    again = fc.make_inputs(case, seed=7, device="cpu")
    assert torch.equal(x.q, again.q) and torch.equal(x.pool, again.pool)
    random = fc.make_inputs(fc.Case("h2_varlen2_random", 2, (3, 5), "random"), seed=7, device="cpu")
    assert random.pool[1:3].abs().max() > 0
    # the reference takes them as they are (bf16 read exactly), at Kimi's head size
    out, final = fc.reference_for(x)
    assert out.shape == (8, 2, fc.HEAD_DIM) and final.shape == (2, 2, fc.HEAD_DIM, fc.HEAD_DIM)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()


def test_default_cases() -> None:
    cases = fc.default_cases()
    assert len(cases) == 3 * 3 * 2 + 3 * 2
    assert len({c.name for c in cases}) == len(cases)
    assert {c.heads for c in cases} == {3, 6, 12}
    assert {c.lengths for c in cases if not c.varlen} == {(64,), (2048,), (8192,)}
    # SGLang's FlashKDA window (kda_flashkda.py _FLASHKDA_CHUNK_SIZE, _FLASHKDA_MAX_SEQ_LEN): the
    # varlen batch is one SGLang sends to FlashKDA, not to its Triton fallback.
    assert 64 <= min(fc.VARLEN_LENGTHS) and max(fc.VARLEN_LENGTHS) <= 2048
    assert fc.case_seed(0, cases[0]) == fc.case_seed(0, cases[0]) != fc.case_seed(1, cases[0])


def _row(name="h3_t64_zeros", fk_out=1e-3, entry=0.0, untouched=True):
    stats = lambda r: {"max_abs": r, "max_rel": r, "rel_rmse": r}  # noqa: E731
    return {
        "case": name, "heads": 3, "lengths": [64], "sglang_routes_to": "flashkda",
        "sglang_entry": {"output_vs_routed_backend": stats(entry)},
        "flashkda": {"median_ms": 0.1, "first_call_ms": 5.0, "other_slots_untouched": untouched},
        "triton": {"median_ms": 0.2, "first_call_ms": 900.0, "other_slots_untouched": True},
        "errors": {
            "flashkda_vs_ref": {"output": stats(fk_out), "state": stats(1e-3)},
            "triton_vs_ref": {"output": stats(1e-3), "state": stats(1e-3)},
            "flashkda_vs_triton": {"output": stats(3e-2), "state": stats(1e-3)},  # within 2x
        },
    }


def test_error_stats() -> None:
    ref = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=F64)
    got = ref + torch.tensor([0.0, 0.1, 0.0, -0.1], dtype=F64)
    s = fc.error_stats(got.to(torch.float32), ref)
    assert s["max_abs"] == pytest.approx(0.1, rel=1e-6)
    assert s["max_rel"] == pytest.approx(0.1 / 2.0, rel=1e-6)
    assert s["rel_rmse"] == pytest.approx(math.sqrt(0.02 / 4) / math.sqrt(5.25 / 4), rel=1e-6)
    assert fc.error_stats(torch.zeros(3), torch.zeros(3)) == {"max_abs": 0.0, "max_rel": 0.0, "rel_rmse": 0.0}
    nan = fc.error_stats(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, 1.0]))
    assert math.isnan(nan["rel_rmse"])


def test_tolerances_name_the_failing_case() -> None:
    assert fc.row_failures(_row()) == []
    failures = fc.row_failures(_row("h12_t8192_random", fk_out=0.5))
    assert failures and all(f.startswith("h12_t8192_random: flashkda_vs_ref output") for f in failures)
    assert any("rel_rmse 0.5 > 0.02 (bfloat16 tolerance)" in f for f in failures), failures
    assert fc.row_failures(_row(fk_out=float("nan")))  # NaN is never within tolerance
    assert fc.row_failures(_row(untouched=False)) == ["h3_t64_zeros: flashkda wrote pool slots outside cache_indices"]
    assert "SGLang's entry point differs" in fc.row_failures(_row(entry=0.3))[0]
    # the bound covers what bf16 rounding alone costs: rounding a random vector once
    x = torch.randn(10_000, dtype=F64, generator=torch.Generator().manual_seed(0))
    once = fc.error_stats(x.to(torch.bfloat16), x)["rel_rmse"]
    assert 1e-3 < once < fc.TOLERANCES["bfloat16"]["rel_rmse"] / 5


def test_table_and_result_file(tmp_path: Path) -> None:
    rows = [_row(), _row("h12_varlen4_random") | {"lengths": [300, 64, 2048, 577]}]
    table = fc.format_table(rows).splitlines()
    assert table[0].split()[:3] == ["case", "heads", "length"] and "flashkda ms" in table[0]
    assert table[2].startswith("h3_t64_zeros") and "300+64+2048+577" in table[3]
    text = fc.result_json({"rows": rows, "b": float("nan"), "a": (1, float("-inf"))})
    assert text.endswith("}\n") and text.isascii()
    data = json.loads(text)
    assert data["b"] == "nan" and data["a"] == [1, "-inf"]
    assert text == json.dumps(data, sort_keys=True, indent=2, ensure_ascii=True) + "\n"


def test_junit_outcomes(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="test_fwd" name="test_fwd"/>'
        '<testcase classname="test_fwd" name="test_fwd_varlen"><failure message="AssertionError: output mismatch">x</failure></testcase>'
        '<testcase classname="test_fwd" name="test_fwd_vs_fla"><failure message="ModuleNotFoundError: No module named \'fla\'"/></testcase>'
        '<testcase classname="" name="tests.conftest"><error message="collection failure"/></testcase>'
        '<testcase classname="test_fwd" name="test_skip"><skipped message="no"/></testcase>'
        '</testsuite></testsuites>')
    got = fc.junit_outcomes(report)
    assert got["counts"] == {"passed": 1, "failed": 2, "error": 1, "skipped": 1}
    assert got["tests"]["test_fwd::test_fwd_varlen"] == {"outcome": "failed", "message": "AssertionError: output mismatch"}
    assert got["tests"]["tests.conftest"]["outcome"] == "error"


def test_flashkda_tests_record_what_ran(tmp_path: Path) -> None:
    got = fc.run_flashkda_tests(tmp_path, timeout=10)
    assert got["ran"] is False and "no such file" in got["why"] and got["unmodified"] is False
    # A tree whose forward test is not the pinned one runs, but says so.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fwd.py").write_text("def test_ok():\n    pass\n\ndef test_bad():\n    assert 0\n")
    got = fc.run_flashkda_tests(tmp_path, timeout=120)
    assert got["unmodified"] is False and got["ran"] is True
    assert got["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 0}, got.get("output_tail")
    assert not (tmp_path / "tests" / "__pycache__").exists()  # nothing written into the tree


def test_pins_and_blob_ids() -> None:
    assert fc.git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"  # `git hash-object`
    assert fc.FLASHKDA_PIN_COMMIT == pins_lock()["pins"]["flashkda"]["commit"]


def test_main_without_a_gpu_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert not torch.cuda.is_available()
    assert fc.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
