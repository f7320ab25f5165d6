"""Train ds4-tiny on the H200 within a fixed wall-clock budget, then export it in the official format.

    python -m training.train --data DIR --config training/ds4_tiny_config.json --tokenizer data/tokenizer/tokenizer.json \
        --out OUT --budget 390

DIR holds the training parts as `<part>.npy` (uint16 token streams; `.npy.xz` is unpacked first) and
`manifest.json` with each part's mixing weight (ds4 corpus build). Batches are random windows of seq+1 tokens,
parts drawn by weight. The step count is set from the first steps' timing so the cosine schedule ends within
the budget. Writes OUT/ckpt (official format, shards under 16 MB), OUT/train_log.json (loss curve,
throughput, judging-slice perplexities, ref-vs-torch logits difference). Imports torch: training only.
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ds4lib.config import ModelConfig
from ds4lib.tokenmap import compressed_token_map
from training.export import export_checkpoint, load_official
from training.model import Model


def load_parts(data: Path):
    man = json.loads((data / "manifest.json").read_text())
    parts, weights = {}, {}
    for name, info in man["parts"].items():
        f = data / f"{name}.npy"
        if not f.exists() and (data / f"{name}.npy.xz").exists():
            f.write_bytes(lzma.decompress((data / f"{name}.npy.xz").read_bytes()))
        parts[name] = np.load(f)
        weights[name] = float(info["weight"])
    return parts, weights


class Batcher:
    def __init__(self, parts, weights, seq, batch, seed, device):
        self.names = sorted(parts)
        self.arrays = [torch.from_numpy(parts[n].astype(np.int64)).to(device) for n in self.names]
        w = np.array([weights[n] for n in self.names])
        self.p = w / w.sum()
        self.seq, self.batch, self.device = seq, batch, device
        self.rng = np.random.default_rng(seed)

    def next(self):
        which = self.rng.choice(len(self.names), size=self.batch, p=self.p)
        rows = []
        for k in which:
            a = self.arrays[k]
            start = int(self.rng.integers(0, len(a) - self.seq - 1))
            rows.append(a[start:start + self.seq + 1])
        return torch.stack(rows)


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() == 2 and "hc_" not in n and "engram.embed" not in n else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


@torch.no_grad()
def slice_ppl(model, slices_dir: Path, device):
    """Teacher-forced perplexity of each judging slice: every window [W, 512] scored as its own sequence."""
    out = {}
    for d in sorted(p for p in slices_dir.iterdir() if p.is_dir()):
        f = d / "judge.tokens.npy"
        if not f.exists():
            continue
        wins = torch.from_numpy(np.load(f).astype(np.int64)).to(device)
        nll, n = 0.0, 0
        for i in range(0, len(wins), 8):
            w = wins[i:i + 8]
            logits, _, _ = model(w[:, :-1])
            nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1),
                                   reduction="sum").item()
            n += w[:, 1:].numel()
        out[d.name] = math.exp(nll / n)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--tokenizer", required=True, type=Path)
    ap.add_argument("--slices", type=Path, default=Path("data/slices"))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget", type=float, default=390.0, help="seconds of training steps")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--anchors", type=int, default=24, help="DSpark blocks per sequence")
    ap.add_argument("--balance-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0, help="cap (0 = set by the budget)")
    ap.add_argument("--init", type=Path, default=None, help="continue from an official-format checkpoint")
    ap.add_argument("--weights", default="", help="override mixing weights, e.g. chat=0.15,dictionary=0.07")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True      # FP32 matmuls of BF16-valued inputs stay exact in TF32
    cfg = ModelConfig.from_json(args.config)
    from tokenizers import Tokenizer
    tmap, n_c = compressed_token_map(Tokenizer.from_file(str(args.tokenizer)))
    # the compressed vocabulary (and with it the hash multipliers) is derived from the tokenizer, never typed in
    cfg = ModelConfig.from_dict({**cfg.to_flat_dict(), "engram_compressed_vocab_size": n_c})
    model = Model(cfg, qat=True, max_pos=max(args.seq, 4096))
    model.set_token_map(tmap)
    if args.init:
        load_official(model, args.init)          # QAT weights are already on the FP4/FP8 grid: nothing is lost
    model = model.to(device)
    parts, weights = load_parts(args.data)
    for item in filter(None, args.weights.split(",")):
        k, v = item.split("=")
        weights[k] = float(v)
    batcher = Batcher(parts, weights, args.seq, args.batch, args.seed, device)
    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device == "cuda")
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device, "weights": weights,
           "params": sum(p.numel() for p in model.parameters()), "steps": []}
    total_steps = args.max_steps or 10 ** 9
    step, tokens, t_loop = 0, 0, time.time()
    moes = [b.ffn for b in list(model.layers) + list(model.mtp)]
    t_mark = None
    while step < total_steps:
        if step == 5:
            t_mark = time.time()
        if step == 15 and not args.max_steps:
            per_step = (time.time() - t_mark) / 10           # steady-state step time (after warm-up)
            total_steps = max(20, int((args.budget - (time.time() - t_loop)) / per_step) + step)
            log["planned_steps"] = total_steps
            log["step_seconds"] = per_step
        lr = args.lr * min(1.0, (step + 1) / args.warmup)
        if step >= args.warmup and total_steps < 10 ** 9:
            prog = (step - args.warmup) / max(1, total_steps - args.warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = batcher.next()
        logits, losses, _ = model(batch[:, :-1], dspark_anchors=args.anchors)
        ce = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
        kl = torch.stack(losses["indexer"]).mean()
        loss = ce + kl + 0.5 * (losses["dspark"] + 0.1 * losses["dspark_conf"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(gn):              # skip a step whose gradient is not finite; keep training
            log.setdefault("skipped_steps", []).append(step)
            opt.zero_grad(set_to_none=True)
        else:
            opt.step()
        for moe in moes:
            moe.balance(args.balance_rate)
        step += 1
        tokens += batch.numel() - len(batch)
        if step % 25 == 0 or step == 1:
            el = time.time() - t_loop
            rec = {"step": step, "lr": lr, "loss": float(loss.detach()), "ce": float(ce.detach()), "indexer_kl": float(kl.detach()),
                   "dspark_ce": float(losses["dspark"].detach()), "dspark_acc": [float(a) for a in losses["dspark_acc"]],
                   "grad_norm": float(gn), "tokens": tokens, "elapsed": el, "tok_per_s": tokens / el}
            log["steps"].append(rec)
            print(json.dumps(rec), flush=True)
    log["train_seconds"] = time.time() - t_loop
    if device == "cuda":
        log["max_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    log["train_tokens"] = tokens
    model.eval()
    log["judge_ppl_torch"] = slice_ppl(model, args.slices, device)
    print("judge ppl", log["judge_ppl_torch"], flush=True)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    ckpt = export_checkpoint(model.cpu(), out / "ckpt", metadata={"generator": "training/train.py"})
    log["export_seconds"] = time.time() - t_start - log["train_seconds"]
    # the exported FP4/FP8 model, loaded back, against the reference forward
    from ds4lib.ref import ReferenceModel
    (ckpt / "tokenizer.json").write_bytes(args.tokenizer.read_bytes())
    check = Model(cfg, qat=True, max_pos=4096)
    check.set_token_map(tmap)
    load_official(check, ckpt).eval()
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
    log["total_seconds"] = time.time() - t_start
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


if __name__ == "__main__":
    main()
