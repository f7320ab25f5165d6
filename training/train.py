"""Train ds4-tiny on the H200 in resumable pieces, then export it in the official format.

    python -m training.train --data DIR --config training/ds4_tiny_config.json \
        --tokenizer data/tokenizer/tokenizer.json --out OUT --state STATE --tokens 200e6 --budget 480

A run is planned once (`RunPlan`: total steps from the token target, schedule, batch, seed, data and config
fingerprints) and then advanced by calls of at most `--budget` seconds each. Every `--save-every` seconds and
at the end of each call the whole training state (weights, AdamW moments, step = data cursor, the plan, the
log) is written to STATE/state.pt (temporary name, then rename), and the next call with the same STATE
resumes it exactly: batch k is drawn from (seed, k) alone, the DSpark anchors too, and nothing else in a step
is random. A call with a different plan (other data, config or knobs) is refused rather than mixed in.
Once the last step is done the call evaluates the judging slices, exports OUT/ckpt (official format, shards
under 16 MB) and checks the exported FP4/FP8 model against the reference forward; OUT/train_log.json holds
the loss curve and throughput.

The step is one compiled graph (torch.compile) of forward and loss; gradients live in one flat buffer, so
clipping and the non-finite guard are a few kernels; nothing in a step reads a value back to the host
(losses are read every `--log-every` steps). Imports torch: training only.

Shapes: B batch rows, T tokens per row, A DSpark anchors per row.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ds4lib.config import ModelConfig
from ds4lib.corpus.training import load_training_set
from ds4lib.tokenmap import compressed_token_map
from training.export import export_checkpoint, export_values, load_model, official_state
from training.judge_ppl import judge
from training.model import Model
from training import sinkhorn as fused_sinkhorn

STATE_FILE = "state.pt"


@dataclass(frozen=True)
class RunPlan:
    """Everything that fixes a run's trajectory; a resumed call must present the same plan."""
    total_steps: int
    batch: int
    seq: int
    lr: float
    warmup: int
    min_lr_frac: float
    wd: float
    anchors: int
    balance_rate: float
    seed: int
    weights: tuple            # ((part, weight), ...) sorted
    data_sha256: str          # of the training set's manifest
    config_sha256: str        # of the model config (with the derived compressed vocabulary)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine from `lr` down to `min_lr_frac * lr` at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        prog = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.lr * (self.min_lr_frac + (1 - self.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


def unpack_parts(data: Path) -> None:
    """`<part>.npy.xz` -> `<part>.npy` beside it, once (the set travels compressed)."""
    man = json.loads((data / "manifest.json").read_text())
    for name in man["parts"]:
        f = data / f"{name}.npy"
        if not f.exists() and (data / f"{name}.npy.xz").exists():
            tmp = f.with_suffix(".npy.tmp")
            tmp.write_bytes(lzma.decompress((data / f"{name}.npy.xz").read_bytes()))
            os.replace(tmp, f)


def draw_anchors(seed: int, step: int, batch: int, anchors: int, seq: int, block: int) -> np.ndarray:
    """int64 [B, A] DSpark anchor positions of step `step` (a function of (seed, step) only)."""
    rng = np.random.default_rng([seed, step, 1])
    return rng.integers(0, seq - block - 1, size=(batch, anchors), dtype=np.int64)


def to_device(a: np.ndarray, device) -> torch.Tensor:
    """Host array -> device tensor without a host wait (pinned staging, asynchronous copy) on the GPU."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device == "cuda" else t


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() == 2 and "hc_" not in n and "engram.embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def flat_grads(params, device) -> torch.Tensor:
    """Point every parameter's .grad into one FP32 buffer (autograd accumulates into it in place)."""
    flat = torch.zeros(sum(p.numel() for p in params), device=device)
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p)
        off += p.numel()
    return flat


class Trainer:
    """The model, its optimiser and the compiled step; `state_dict`/`load_state_dict` are the checkpoint."""

    def __init__(self, cfg, plan: RunPlan, tmap, device, compile_step: bool):
        self.cfg, self.plan, self.device = cfg, plan, device
        torch.manual_seed(plan.seed)                      # initial weights only; steps draw nothing from torch
        self.model = Model(cfg, qat=True, max_pos=max(plan.seq, 4096))
        self.model.set_token_map(tmap)
        self.model.to(device)
        self.params = [p for p in self.model.parameters()]
        self.flat = flat_grads(self.params, device)
        self.opt = torch.optim.AdamW(param_groups(self.model, plan.wd), lr=plan.lr, betas=(0.9, 0.95), eps=1e-8,
                                     fused=device == "cuda", foreach=None if device == "cuda" else False)
        self.moes = [b.ffn for b in list(self.model.layers) + list(self.model.mtp)]
        self.nonfinite = torch.zeros((), device=device)
        self.step = 0
        self.tokens = 0
        self._loss = torch.compile(self._loss_fn, dynamic=False) if compile_step else self._loss_fn

    def _loss_fn(self, tokens, anchors):
        logits, losses, _ = self.model(tokens[:, :-1], dspark_anchors=anchors)
        ce = F.cross_entropy(logits.reshape(-1, self.cfg.vocab_size), tokens[:, 1:].reshape(-1))
        kl = torch.stack(losses["indexer"]).mean()
        loss = ce + kl + 0.5 * (losses["dspark"] + 0.1 * losses["dspark_conf"])
        return loss, torch.stack([ce, kl, losses["dspark"]]), losses["dspark_acc"], losses["load"]

    def train_step(self, tokens, anchors):
        """One optimiser step on device tensors; returns device tensors (no host read)."""
        lr = self.plan.lr_at(self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.flat.zero_()
        loss, parts, acc, loads = self._loss(tokens, anchors)
        loss.backward()
        gn = self.flat.norm()
        ok = torch.isfinite(gn)
        # clip to norm 1; a non-finite gradient is zeroed (the step then moves on momentum only) and counted
        self.flat.mul_(torch.clamp(1.0 / (gn + 1e-6), max=1.0))
        self.flat.nan_to_num_(0.0, 0.0, 0.0).mul_(ok)
        self.nonfinite += (~ok).float()
        self.opt.step()
        for moe, load in zip(self.moes, loads):
            moe.balance(load, self.plan.balance_rate)
        self.step += 1
        self.tokens += tokens.shape[0] * (tokens.shape[1] - 1)
        return loss.detach(), parts.detach(), acc.detach(), gn.detach()

    def state_dict(self):
        return {"plan": asdict(self.plan), "step": self.step, "tokens": self.tokens,
                "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                "nonfinite": float(self.nonfinite)}

    def load_state_dict(self, sd):
        mine = {**asdict(self.plan), "total_steps": None}
        saved = {**sd["plan"], "total_steps": None}           # the step count may have been fitted to time
        if saved != mine:
            diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
            raise SystemExit(f"train: the saved state was planned differently; refusing to mix runs: {diff}")
        self.plan = RunPlan(**{**sd["plan"], "weights": tuple(tuple(w) for w in sd["plan"]["weights"])})
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])             # parameters are copied in place: .grad views stay
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])
        self.nonfinite.fill_(sd["nonfinite"])


def save_state(trainer: Trainer, state_dir: Path, log: dict) -> float:
    """Write STATE/state.pt atomically; returns seconds taken."""
    t = time.time()
    state_dir.mkdir(parents=True, exist_ok=True)
    sd = trainer.state_dict()
    sd["log"] = log
    tmp = state_dir / (STATE_FILE + ".tmp")
    torch.save(sd, tmp)
    os.replace(tmp, state_dir / STATE_FILE)
    return time.time() - t


class Snapshotter:
    """Periodic exports of the weights so far (official format) while training goes on: the values are copied
    to the host in the training thread, quantised and written by a background thread into DIR.tmp, then
    renamed to DIR, so DIR always holds one whole snapshot."""

    def __init__(self, model, out_dir: Path):
        self.model, self.out_dir, self.thread, self.done = model, out_dir, None, []

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, step: int, log: dict):
        if self.busy():
            return False
        values = official_state(self.model)
        meta = {"generator": "training/train.py", "step": str(step)}
        log_text = json.dumps(log, indent=1)

        def work():
            t = time.time()
            tmp = self.out_dir.with_name(self.out_dir.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            export_values(self.model.cfg, values, tmp, metadata=meta)
            (tmp / "train_log.json").write_text(log_text)
            old = self.out_dir.with_name(self.out_dir.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if self.out_dir.exists():
                os.replace(self.out_dir, old)
            os.replace(tmp, self.out_dir)
            shutil.rmtree(old, ignore_errors=True)
            self.done.append({"step": step, "seconds": round(time.time() - t, 1)})

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()
        return True

    def join(self):
        if self.thread is not None:
            self.thread.join()


def compile_cache(path: Path | None, save: bool) -> dict:
    """Load (save=False) or save the compiler's portable cache artifacts (inductor, Triton and autograd caches)
    so a fresh GPU machine can skip most of the cold compilation; best effort, reports what happened."""
    if path is None:
        return {}
    try:
        if save:
            got = torch.compiler.save_cache_artifacts()
            if got is None:
                return {"saved": 0}
            data = got[0]
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return {"saved": len(data)}
        if path.exists():
            torch.compiler.load_cache_artifacts(path.read_bytes())
            return {"loaded": path.stat().st_size}
        return {"loaded": 0}
    except Exception as e:                       # the cache only saves time; training never depends on it
        return {"error": f"{type(e).__name__}: {e}"}


def slice_ppl(model, slices_dir: Path, device):
    """Teacher-forced perplexity of each judging slice: every window [W, 512] scored as its own sequence."""
    return {d.name: judge(model, np.load(d / "judge.tokens.npy"), batch=8, device=device)["ppl"]
            for d in sorted(p for p in slices_dir.iterdir() if p.is_dir()) if (d / "judge.tokens.npy").exists()}


def make_plan(args, cfg, data_dir: Path, weights: dict) -> RunPlan:
    per_step = args.batch * args.seq
    return RunPlan(total_steps=max(1, math.ceil(args.tokens / per_step)), batch=args.batch, seq=args.seq,
                   lr=args.lr, warmup=args.warmup, min_lr_frac=args.min_lr_frac, wd=args.wd, anchors=args.anchors,
                   balance_rate=args.balance_rate, seed=args.seed, weights=tuple(sorted(weights.items())),
                   data_sha256=hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest(),
                   config_sha256=hashlib.sha256(json.dumps(cfg.to_flat_dict(), sort_keys=True).encode()).hexdigest())


def export_and_check(trainer: Trainer, cfg, tmap, args, log):
    """Judging-slice perplexity (torch), export to OUT/ckpt, and the exported model against the reference."""
    model = trainer.model.eval()
    log["judge_ppl_torch"] = slice_ppl(model, args.slices, trainer.device)
    print("judge ppl", log["judge_ppl_torch"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = export_checkpoint(model.cpu(), args.out / "ckpt", metadata={"generator": "training/train.py"})
    from ds4lib.ref import ReferenceModel
    (ckpt / "tokenizer.json").write_bytes(args.tokenizer.read_bytes())
    check = load_model(ckpt, tmap, cfg)
    ref = ReferenceModel.load(ckpt)
    win = np.load(sorted(args.slices.glob("*/judge.tokens.npy"))[0])[0].astype(np.int64)
    with torch.no_grad():
        lt = check(torch.from_numpy(win)[None])[0][0].numpy()
    lr_ = ref.logits(win)
    log["ref_vs_torch"] = {"tokens": int(len(win)), "max_abs": float(np.abs(lt - lr_).max()),
                           "rel": float(np.linalg.norm(lt - lr_) / np.linalg.norm(lr_)),
                           "argmax_agree": float(np.mean(lt.argmax(-1) == lr_.argmax(-1)))}
    (ckpt / "tokenizer.json").unlink()
    print("ref vs torch", log["ref_vs_torch"], flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--slices", type=Path, default=Path("data/slices"))
    ap.add_argument("--out", required=True, type=Path, help="export folder (written after the last step)")
    ap.add_argument("--state", required=True, type=Path, help="resumable training state folder")
    ap.add_argument("--tokens", type=float, default=200e6, help="training tokens of the whole run")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds of training in this call")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds after this process starts by which a new run's last step must end (compilation "
                         "included): the plan is shortened to fit from the measured step time (0: off)")
    ap.add_argument("--fit-steps", default="10,30",
                    help="A,B: with --deadline or --total-budget the step time is measured over steps A..B and the "
                         "plan fitted at step B (the first steps are slower: compilation, allocator warm-up)")
    ap.add_argument("--snapshot-every", type=float, default=0.0,
                    help="seconds between background exports of the weights so far to --snapshot (0: only when "
                         "a call ends unfinished)")
    ap.add_argument("--compile-cache", type=Path, default=None,
                    help="the compiler's cache artifacts: loaded before the first step when present, written after it")
    ap.add_argument("--total-budget", type=float, default=0.0,
                    help="seconds of training for the whole run: a new run measures its step time before the "
                         "warm-up ends and shortens the plan to fit (0: --tokens decides alone)")
    ap.add_argument("--save-every", type=float, default=180.0, help="seconds between state saves")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--anchors", type=int, default=24, help="DSpark blocks per sequence")
    ap.add_argument("--balance-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--weights", default="", help="override mixing weights, e.g. chat=0.15,dictionary=0.07")
    ap.add_argument("--stop-at", type=int, default=0, help="end this call at this step (0: budget only)")
    ap.add_argument("--no-compile", action="store_true", help="eager steps (debugging, CPU tests)")
    ap.add_argument("--no-export", action="store_true", help="stop after the last step without exporting")
    ap.add_argument("--snapshot", type=Path, default=None,
                    help="when a call ends before the last step, export the weights so far here")
    args = ap.parse_args(argv)
    try:
        fit_a, fit_b = (int(v) for v in args.fit_steps.split(","))
    except ValueError:
        ap.error(f"--fit-steps must be two integers A,B, got {args.fit_steps!r}")
    if not 0 <= fit_a < fit_b:
        ap.error(f"--fit-steps needs 0 <= A < B, got {args.fit_steps!r}")
    args.fit_steps = (fit_a, fit_b)
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True      # FP32 matmuls of BF16-valued inputs stay exact in TF32
    cfg = ModelConfig.from_json(args.config)
    from tokenizers import Tokenizer
    tmap, n_c = compressed_token_map(Tokenizer.from_file(str(args.tokenizer)))
    # the compressed vocabulary (and with it the hash multipliers) is derived from the tokenizer, never typed in
    cfg = ModelConfig.from_dict({**cfg.to_flat_dict(), "engram_compressed_vocab_size": n_c})
    unpack_parts(args.data)
    weights = {k: v["weight"] for k, v in json.loads((args.data / "manifest.json").read_text())["parts"].items()}
    for item in filter(None, args.weights.split(",")):
        k, v = item.split("=")
        weights[k] = float(v)
    train_set = load_training_set(args.data, weights=weights)
    plan = make_plan(args, cfg, args.data, weights)
    trainer = Trainer(cfg, plan, tmap, device, compile_step=not args.no_compile)
    log = {"plan": asdict(plan), "device": device, "params": sum(p.numel() for p in trainer.params),
           "steps": [], "calls": []}
    checks = {}
    if device == "cuda":
        checks["sinkhorn"] = fused_sinkhorn.self_check(iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps)
        print("train: fused Sinkhorn", json.dumps(checks["sinkhorn"]), flush=True)
    if not args.no_compile:
        checks["compile_cache_load"] = compile_cache(args.compile_cache, save=False)
    state_path = args.state / STATE_FILE
    if state_path.exists():
        sd = torch.load(state_path, map_location=device, weights_only=False)
        trainer.load_state_dict(sd)
        log = sd["log"]
        print(f"train: resumed at step {trainer.step} of {trainer.plan.total_steps} ({trainer.tokens:,} tokens)",
              flush=True)
    call = {"start_step": trainer.step, "budget": args.budget, **checks}
    snap = Snapshotter(trainer.model, args.snapshot) if args.snapshot and args.snapshot_every > 0 else None
    block = cfg.dspark_block_size
    t_loop = time.time()
    t_saved = t_loop
    t_first = None
    start_tokens = trainer.tokens
    fit_plan = (args.total_budget > 0 or args.deadline > 0) and trainer.step == 0
    fit_a, fit_b = args.fit_steps
    t_fit = None
    while trainer.step < min(trainer.plan.total_steps, args.stop_at or trainer.plan.total_steps) \
            and time.time() - t_loop < args.budget:
        step = trainer.step
        plan = trainer.plan
        if fit_plan and step in (fit_a, fit_b):
            if device == "cuda":
                torch.cuda.synchronize()
            if step == fit_a:
                t_fit = time.time()
            else:                                 # steady step time over steps A..B, then the plan is fixed
                per_step = (time.time() - t_fit) / (fit_b - fit_a)
                if args.deadline > 0:     # wall clock from process start; 2% of the step time kept in reserve
                    fitted = int((t_start + args.deadline - time.time()) / (per_step * 1.02)) + step
                else:                     # the budget counts training time; the first step's compilation is not part of it
                    fitted = int((args.total_budget - (time.time() - t_first)) / per_step) + step
                trainer.plan = replace(plan, total_steps=max(step + 1, min(plan.total_steps, fitted)))
                log["plan"] = asdict(trainer.plan)
                log["fitted"] = {"step_seconds": per_step, "total_steps": trainer.plan.total_steps}
                print("train: plan fitted", json.dumps(log["fitted"]), flush=True)
                fit_plan = False
        rows = train_set.draw_batch(step, batch=plan.batch, seq_len=plan.seq, seed=plan.seed)       # [B, T+1]
        anc = draw_anchors(plan.seed, step, plan.batch, plan.anchors, plan.seq, block)               # [B, A]
        loss, parts, acc, gn = trainer.train_step(to_device(rows, device), to_device(anc, device))
        if t_first is None:
            if device == "cuda":
                torch.cuda.synchronize()
            t_first = time.time()                      # the first step carries the compilation
            call["first_step_seconds"] = t_first - t_loop
            print(f"train: first step (compilation) {t_first - t_loop:.1f} s", flush=True)
            steady_tokens = trainer.tokens
            t_snap = t_first
            if not args.no_compile and args.compile_cache is not None:
                call["compile_cache_save"] = compile_cache(args.compile_cache, save=True)
                print("train: compile cache", json.dumps(call["compile_cache_save"]), flush=True)
        if trainer.step % args.log_every == 0 or trainer.step == trainer.plan.total_steps:
            el = time.time() - t_first
            rec = {"step": trainer.step, "lr": plan.lr_at(trainer.step - 1), "loss": float(loss),
                   "ce": float(parts[0]), "indexer_kl": float(parts[1]), "dspark_ce": float(parts[2]),
                   "dspark_acc": [round(float(a), 4) for a in acc], "grad_norm": float(gn),
                   "tokens": trainer.tokens, "call_seconds": round(time.time() - t_loop, 1),
                   "tok_per_s": (trainer.tokens - steady_tokens) / el if el > 0 else None,
                   "nonfinite_steps": float(trainer.nonfinite)}
            log["steps"].append(rec)
            print(json.dumps(rec), flush=True)
        if snap is not None and time.time() - t_snap > args.snapshot_every and trainer.step < trainer.plan.total_steps:
            if snap.start(trainer.step, log):
                t_snap = time.time()
        if time.time() - t_saved > args.save_every:
            call.setdefault("save_seconds", []).append(round(save_state(trainer, args.state, log), 2))
            t_saved = time.time()
    if snap is not None:
        snap.join()
        call["snapshots"] = snap.done
    if device == "cuda":
        torch.cuda.synchronize()
        call["max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    t_end = time.time()
    call.update({"end_step": trainer.step, "seconds": t_end - t_loop, "tokens": trainer.tokens - start_tokens})
    if t_first is not None and trainer.step - call["start_step"] > 1:
        call["steady_tok_per_s"] = (trainer.tokens - steady_tokens) / (t_end - t_first)
    log["calls"].append(call)
    print("call", json.dumps(call), flush=True)
    call.setdefault("save_seconds", []).append(round(save_state(trainer, args.state, log), 2))
    if trainer.step >= trainer.plan.total_steps and not args.no_export:
        log["train_tokens"] = trainer.tokens
        log["nonfinite_steps"] = float(trainer.nonfinite)
        export_and_check(trainer, cfg, tmap, args, log)
        log["export_seconds"] = time.time() - t_end
        (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    elif args.snapshot:
        # insurance while the run is unfinished: the weights so far in the official format (52 MB), which
        # travel back from the GPU machine where the full state (weights + moments, ~0.9 GB) cannot
        snap = snap or Snapshotter(trainer.model, args.snapshot)
        snap.start(trainer.step, log)
        snap.join()
    print(f"train: step {trainer.step}/{trainer.plan.total_steps}, {time.time() - t_start:.0f} s in this call",
          flush=True)
    return trainer


if __name__ == "__main__":
    main()
