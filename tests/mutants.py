"""Do the tests catch the bugs they are there to catch? A small mutation check, run in CI.

    python tests/mutants.py            # every mutant; exit 1 if one survives or no longer applies
    python tests/mutants.py --list     # the mutants and the tests each one runs
    python tests/mutants.py NAME ...   # some of them

Each mutant is one deliberate bug of a kind that once passed the suite (per-row offsets ignored,
the key mask taken from the query mask, a rotation sign flipped, a state dropped, top-k
ignored, ...). For each, the package and the tests are copied to a temporary directory, the
bug is written into the copy (an exact piece of text, which must occur exactly once: if the
code moved on and the text is gone, the script fails instead of silently checking nothing),
and the tests named for it run against the copy in a subprocess (``PYTHONPATH`` = the copy).
The mutant is *killed* when pytest reports failing tests (exit 1), *survives* when they pass
(exit 0); any other exit (nothing collected, a crash at import) is an error. The tests must
pass on the unchanged code (CI runs the whole suite first; ``--baseline`` checks just these).
Two mutants run at a time; the check costs about 2 CPU-minutes (1m45s user time measured), and
the fused path's (a 20-step training in Triton's interpreter) about 70 CPU-seconds more.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str  # what the bug is
    path: str  # the file, relative to the repository root
    old: str  # exact text, found exactly once
    new: str  # what it becomes
    tests: list[str]  # pytest arguments, relative to the copy's root


OPS = "linear_rope/ops/"
MUTANTS = [
    Mutant("per-row offsets ignored on the fast path", OPS + "chunk.py",
           "aux = [none if t is None else t for t in (a.kmask, w, a.positions)]",
           "aux = [none if t is None else t for t in (a.kmask, w, None if a.qmask is None else a.positions)]",
           ["tests/test_ops.py", "-k", "keywords_match_reference and offsets and all-kept",
            "tests/test_keywords_layer.py", "-k", "per_row_offsets"]),
    Mutant("per-document offsets ignored (packed documents)", "linear_rope/rotary.py",
           "off = offset[d : d + 1] if isinstance(offset, torch.Tensor) else offset",
           "off = 0",
           ["tests/test_ops.py", "-k", "keywords_match_reference and cu+offsets and all-kept",
            "tests/test_keywords_layer.py", "-k", "packed_documents_with_offsets"]),
    Mutant("per-row positions ignored by the one-token step", OPS + "recurrent.py",
           "pos = position.view(B, 1, 1) if isinstance(position, torch.Tensor) else None",
           "pos = position.view(B, 1, 1)[:1].expand(B, 1, 1) if isinstance(position, torch.Tensor) else None",
           ["tests/test_keywords_layer.py", "-k", "per_row_offsets or ragged",
            "tests/test_model.py", "-k", "ragged_prefill"]),
    Mutant("cross-attention key mask taken from the query mask (op)", OPS + "utils.py",
           "kmask = None if cross else qmask", "kmask = qmask",
           ["tests/test_keywords_op.py", "-k", "cross_attention"]),
    Mutant("cross-attention key mask taken from the query mask (layer)", "linear_rope/attention.py",
           "key_mask = context_mask if context_mask is not None else torch.ones(",
           "key_mask = context_mask if context is None else torch.ones(",
           ["tests/test_keywords_layer.py", "-k", "cross_attention"]),
    Mutant("rotation sign flipped in the chunked kernel", OPS + "chunk_fwd.py",
           "torch.view_as_complex(phi.reshape(*shape, 2)) * rot)",
           "torch.view_as_complex(phi.reshape(*shape, 2)) * rot.conj())",
           ["tests/test_ops.py", "-k", "chunked_matches_reference and causal and rope and N63"]),
    Mutant("rotation sign flipped in rotate_with_tables", "linear_rope/rotary.py",
           "out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)",
           "out = torch.stack((x1 * cos + x2 * sin, -x1 * sin + x2 * cos), dim=-1)",
           ["tests/test_rotary.py", "tests/test_ops.py", "-k", "recurrent_matches_reference and N63"]),
    Mutant("initial state dropped on the chunked path", OPS + "chunk.py",
           "    if a.state is None:\n        S0, z0 =", "    if True:\n        S0, z0 =",
           ["tests/test_keywords_op.py", "-k", "two_chained_calls or initial_state"]),
    Mutant("state dropped by the one-token step", OPS + "recurrent.py",
           "S, z = state.S.to(cdt) + S, state.z.to(cdt) + z", "S, z = S, state.z.to(cdt) + z",
           ["tests/test_ops.py", "-k", "prefill_state_then_steps"]),
    Mutant("state dropped on the bidirectional path", OPS + "chunk.py",
           "S, z = S + a.state.S.to(S.dtype), z + a.state.z.to(z.dtype)", "S, z = S, z + a.state.z.to(z.dtype)",
           ["tests/test_keywords_op.py", "-k", "initial_state_and_final_state and bidir"]),
    Mutant("a layer's state dropped by PerformerLM.step", "linear_rope/model.py",
           "        for block, state in zip(self.blocks, states):",
           "        states = list(states[:-1]) + [None]\n        for block, state in zip(self.blocks, states):",
           ["tests/test_model.py", "-k", "greedy_generation and rope and not rope_"]),
    Mutant("state list of the wrong length accepted by step", "linear_rope/model.py",
           "if not listed or len(states) != len(self.blocks) or", "if not listed or",
           ["tests/test_model.py", "-k", "step_refuses"]),
    Mutant("top-k ignored when sampling", "linear_rope/sampling.py",
           "if top_k is not None and top_k < logits.shape[-1]:", "if False:",
           ["tests/test_model.py", "-k", "top_k"]),
    Mutant("per-row positions ignored by the Decoder", "linear_rope/decode_step.py",
           "row = dec.positions - dec.first", "row = (dec.positions - dec.first)[:1].expand(dec.B)",
           ["tests/test_decode.py", "-k", "functional_step and fp64 and rope"]),
    Mutant("the Decoder's held bf16 weights never recast after a training step", "linear_rope/held_weights.py",
           'if sig != c["sig"]:', 'if c["sig"] is None:',
           ["tests/test_decode.py", "-k", "training_step_between"]),
    Mutant("the compiled Decoder step reads the query out of the state before the token",
           "linear_rope/decode_step.py",
           "* new).sum(-1)  # (B, H, E)", "* Sz).sum(-1)  # (B, H, E)",
           ["tests/test_decode.py", "-k", "compiled_step_equals and rope and not rope_norm"]),
    Mutant("the compiled Decoder step's key features without their -|k'|^2/2", "linear_rope/decode_step.py",
           "lin.sub(sq, alpha=0.5).clamp(", "lin.clamp(",
           ["tests/test_decode.py", "-k", "compiled_step_equals and rope and not rope_norm"]),
    Mutant("bf16 output negated", OPS + "prepare.py",
           "out = out[..., :e].to(out_dtype)",
           "out = out[..., :e].to(out_dtype)\n    out = -out if out_dtype == torch.bfloat16 else out",
           ["tests/test_ops.py", "tests/test_favor_attention.py", "-k", "bf16"]),
    Mutant("all-zero output (causality tests must see later outputs move)", OPS + "prepare.py",
           "out = out[..., :e].to(out_dtype)", "out = out[..., :e].to(out_dtype) * 0",
           ["tests/test_ops.py", "tests/test_favor_attention.py", "-k", "strictly"]),
    Mutant("feature scale not normalised", OPS + "utils.py",
           "    return q / sq, k / skt, state, sk", "    return q, k, state, torch.ones_like(sk)",
           ["tests/test_keywords_op.py", "-k", "scale and fp32"]),
    Mutant("workspace pool keyed without inference mode", OPS + "workspace.py",
           "key = (n, like.dtype, torch.is_inference_mode_enabled())", "key = (n, like.dtype)",
           ["tests/test_caches.py", "-k", "inference"]),
    Mutant("parallel path: the projection's operands cached on address and version", OPS + "parallel.py",
           "else _projection_operands(w, lowp)",
           "else _projection_operands.__dict__.setdefault((w.data_ptr(), w._version, tuple(w.shape), w.dtype, lowp), "
           "_projection_operands(w, lowp))",
           ["tests/test_caches.py", "-k", "projection"]),
    Mutant("workspace hands out buffers still in use", OPS + "workspace.py",
           "            if _use_count(b) == idle:", "            if True:", ["tests/test_workspace.py"]),
    Mutant("auto takes the chunk-parallel path off CUDA", OPS + "backend.py",
           'return name == "parallel" or (name in ("auto", "fused") and q.is_cuda)',
           'return name in ("parallel", "auto", "fused")',
           ["tests/test_parallel.py", "-k", "auto"]),
    Mutant("packed documents on the chunk-parallel backend kept there", OPS + "backend.py",
           "    elif par and not packed:", "    elif par:",
           ["tests/test_parallel.py", "-k", "packed"]),
    Mutant("download: a declared Content-Length above the bound accepted", "linear_rope/enwik8/fetch.py",
           "            if declared is not None and declared > limit:", "            if False:",
           ["tests/test_download.py", "-k", "declared_length_above_the_bound"]),
    Mutant("download: a body shorter than its Content-Length kept", "linear_rope/enwik8/fetch.py",
           "    if declared is not None and written != declared:", "    if False:",
           ["tests/test_download.py", "-k", "short_body"]),
    Mutant("run-folder lock taken shared (two writers in one run folder)", "linear_rope/enwik8/rundir.py",
           "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
           ["tests/test_run_folder.py", "-k", "second_run or other_names"]),
    Mutant("checkpoint content digest not verified on load", "linear_rope/enwik8/checkpoint.py",
           "    if DIGEST in ckpt and content_digest(ckpt) != ckpt[DIGEST]:", "    if False:",
           ["tests/test_run_folder.py", "-k", "flipped_byte"]),
    Mutant("checkpoint param_sha256 not verified on resume and sample", "linear_rope/enwik8/checkpoint.py",
           "    if got != want:", "    if False:",
           ["tests/test_run_folder.py", "-k", "without_content_digest"]),
    Mutant("forward-mode AD through the custom op (a silent zero tangent)", OPS + "backend.py",
           '    if transformed:\n        return "composite"', '    if False:\n        return "composite"',
           ["tests/test_op_safety.py", "-k", "forward_mode_ad and causal-features-plain"]),
    Mutant("padding multiplied by the mask instead of selected", OPS + "chunk_fwd.py",
           "    return torch.where(kmc.unsqueeze(-1) > 0, x, 0).contiguous()",
           "    return (x * kmc.unsqueeze(-1)).contiguous()",
           ["tests/test_op_safety.py", "-k", "padding_is_selected and chunk-torch-features"]),
    Mutant("feature scale per call instead of per packed document", OPS + "utils.py",
           'sk = ka.new_zeros(H, len(docs)).scatter_reduce_(1, seg.expand(H, -1), ka[0], "amax").t()',
           "sk = ka.amax(-1).expand(len(docs), -1)",
           ["tests/test_op_safety.py", "-k", "very_different_scales"]),
    Mutant("feature-sign check skipped under torch.compile", OPS + "utils.py",
           "        torch._assert_async(low >= 0, msg)\n", "",
           ["tests/test_keywords_op.py", "-k", "under_compile"]),
    Mutant("parallel path: the prefix over chunks sums only the previous chunk", OPS + "parallel.py",
           "Sb = torch.cat((S0[:, :, None], Sc[:, :, :-1]), dim=2).cumsum(2)",
           "Sb = torch.cat((S0[:, :, None], Sc[:, :, :-1]), dim=2)",
           ["tests/test_parallel.py", "-k", "matches_the_float64 and state and 257"]),
    Mutant("parallel path: denominator from the rotated features", OPS + "parallel.py",
           "D = mm32(Qf, Kf.transpose(-1, -2))",
           "D = mm32(Qr, Kr.transpose(-1, -2))",
           ["tests/test_parallel.py", "-k", "matches_the_float64 and plain and 63"]),
    Mutant("parallel path: double backward through the hand-written backward not refused (wrong second derivatives)",
           OPS + "parallel.py",
           "        if torch.is_grad_enabled():\n            raise RuntimeError(DOUBLE_BACKWARD)\n", "",
           ["tests/test_autocast_backward.py", "-k", "double_backward and bf16"]),
    Mutant("RoPE angles of a position past MAX_POSITION (a wrapped int64 sum) left finite", "linear_rope/rotary.py",
           '        turns = turns.masked_fill((mag >> 62) != 0, float("nan"))\n', "        pass\n",
           ["tests/test_positions.py", "-k", "rope_turns or explicit_positions"]),
    Mutant("parallel path: RoPE angles of per-row positions past MAX_POSITION left finite", OPS + "rope_tables.py",
           '        turns = turns.masked_fill((mag >> 62) != 0, float("nan"))\n', "        pass\n",
           ["tests/test_positions.py", "-k", "per_row_offsets_past_the_bound and parallel"]),
    Mutant("torch path: the custom backward runs under the caller's autocast", OPS + "chunk_op.py",
           "    with torch.autocast(v.device.type, enabled=False):  # a backward called inside an autocast block",
           "    with torch.autocast(v.device.type):  # a backward called inside an autocast block",
           ["tests/test_autocast_backward.py", "-k", "op_backward_inside and torch-features"]),
    Mutant("fla path: denominator from the rotated features", OPS + "fla_path.py",
           "d, z = _fla(F.pad(fq[..., s:t], pad).to(fdt), F.pad(fk[..., s:t], pad).to(fdt),",
           "d, z = _fla(F.pad(rq[..., s:t], pad).to(fdt), F.pad(rk[..., s:t], pad).to(fdt),",
           ["tests/test_fla_path.py", "-k", "matches_reference and none-features-rope"]),
    Mutant("Hugging Face generate reads only the last token after a prefix cache", "linear_rope/hf/modeling.py",
           "input_ids = input_ids[:, cache.seen:]", "input_ids = input_ids[:, -1:]",
           ["tests/test_hf.py", "-k", "prefix"]),
    Mutant("Hugging Face from_pretrained builds before checking the config against the weights",
           "linear_rope/hf/loading.py",
           "        check_config_fits(cfg, shapes, file, named, defaulted)\n", "",
           ["tests/test_hf.py", "-k", "lacks or before_anything"]),
    Mutant("Hugging Face config: the remote code's subclass loses the package's __init__",
           "linear_rope/hf/configuration.py",
           "            cls.__init__ = LinearRopeConfig.__init__\n", "            pass\n",
           ["tests/test_hf.py", "-k", "takes_its_default"]),
    Mutant("Hugging Face forward: the attention mask's values unchecked", "linear_rope/hf/inputs.py",
           "        bad = (v != 0) & (v != 1)\n", "        bad = v != v\n",
           ["tests/test_hf.py", "-k", "checks_its_inputs and torch"]),
    Mutant("export skips sample's checkpoint verification", "linear_rope/hf/export.py",
           "    model, ckpt, path = load_verified(path)\n",
           "    from ..enwik8.checkpoint import load_checkpoint, resolve_checkpoint\n"
           "    from ..model import ModelConfig\n    path = resolve_checkpoint(path)\n    ckpt = load_checkpoint(path)\n"
           "    model = PerformerLM(ModelConfig(**ckpt['config']['model']))\n    model.load_state_dict(ckpt['model'])\n",
           ["tests/test_export.py", "-k", "nan_weights or wrong_digest"]),
    Mutant("parallel path: the chunkwise denominator drops the key sums before the chunk", OPS + "parallel.py",
           "den = D.sum(-1, keepdim=True) + (Qf * zb[..., None, :])",
           "den = D.sum(-1, keepdim=True) + 0 * (Qf * zb[..., None, :])",
           ["tests/test_parallel.py", "-k", "matches_the_float64 and plain and 257"]),
    Mutant("parallel path: the backward's recomputed features not rotated", OPS + "parallel.py",
           "            Qr, Qf, Kr, Kf = _operands(fq, fk, cos2, sin2, rd, C)",
           "            Qr, Qf, Kr, Kf = _operands(fq, fk, None, None, rd, C)",
           ["tests/test_parallel.py", "-k", "recompute_above"]),
    Mutant("fused path: the state carried across chunks dropped (each chunk's S from the previous chunk alone)",
           OPS + "fused/forward.py",
           "        S_e += _dot(tl.trans(_op(re, LOWP)), vt, LOWP)\n        S_o += _dot(",
           "        S_e = _dot(tl.trans(_op(re, LOWP)), vt, LOWP)\n        S_o = _dot(",
           ["tests/test_fused_kernel.py", "-k", "small_model_trains"]),
]


def run_one(m: Mutant, timeout: float, mutate: bool = True) -> tuple[str, float, str]:
    """(verdict, seconds, detail): killed / SURVIVED / NOT APPLIED / ERROR. ``mutate=False``
    runs the same tests on the unchanged copy (``--baseline``), where they must pass."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        copy = Path(tmp)
        for part in ("linear_rope", "tests", "benchmarks"):
            shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        target = copy / m.path
        text = target.read_text()
        n = text.count(m.old)
        if n != 1:
            return "NOT APPLIED", 0.0, f"the text to mutate occurs {n} times in {m.path}"
        if mutate:
            target.write_text(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "ERROR", time.monotonic() - t0, f"timed out after {timeout:.0f} s"
    secs = time.monotonic() - t0
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode == 1:
        return "killed", secs, last
    if proc.returncode == 0:
        return "SURVIVED", secs, last
    return "ERROR", secs, f"pytest exit {proc.returncode}: {last}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="run only mutants whose name contains one of these")
    p.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per mutant (default 300)")
    p.add_argument("--baseline", action="store_true",
                   help="run each mutant's tests on the unchanged code instead: they must all pass "
                        "(CI runs the whole suite first, which covers this)")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or any(n in m.name for n in args.names)]
    if args.list:
        for m in chosen:
            print(f"{m.name}\n    {m.path}: {' '.join(m.tests)}")
        return 0
    if not chosen:
        print(f"no mutant matches {args.names}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda m: run_one(m, args.timeout, not args.baseline), chosen))
    if args.baseline:  # unchanged code: passing is the right verdict
        names = {"SURVIVED": "passes", "killed": "FAILS"}
        results = [(names.get(v, v), s, d) for v, s, d in results]
    width = max(len(m.name) for m in chosen)
    print(f"{'mutant':<{width}}  {'verdict':<11}  {'s':>5}  tests")
    for m, (verdict, secs, detail) in zip(chosen, results):
        print(f"{m.name:<{width}}  {verdict:<11}  {secs:5.1f}  {detail}")
    want = "passes" if args.baseline else "killed"
    bad = [m.name for m, (v, _, _) in zip(chosen, results) if v != want]
    print(f"{len(chosen) - len(bad)} of {len(chosen)} {'baselines pass' if args.baseline else 'mutants killed'} "
          f"in {time.monotonic() - t0:.0f} s" + (f"; not as expected: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
