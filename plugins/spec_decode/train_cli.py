"""``patchbay-train-drafter``: train Medusa heads or an EAGLE(-3) draft layer for a model, on the CPU, in minutes.

    patchbay-train-drafter medusa --minutes 3 --out DIR
    patchbay-train-drafter eagle --minutes 3
    patchbay-train-drafter eagle3 --minutes 3 --aux-sequences 96

The target generates a corpus from varied prompts (cached next to the
drafters, so the second kind reuses it), the drafter trains for
``--minutes`` of wall clock, and the acceptance it reaches on held-out
generations is printed and recorded in the output's ``config.json``.
EAGLE-3 also needs the outputs of the target layers it reads: one
teacher-forced pass over the corpus computes them (for ``--aux-sequences``
training sequences and the held-out ones; cached too).  Use
the result with ``spec_decode: {name: medusa, options: {path: DIR}}``
(``path: auto`` finds the default output directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_MINUTES = 3.0


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(
        prog="patchbay-train-drafter",
        description="Train speculative-decoding drafters (Medusa heads, EAGLE / EAGLE-3 layer) by self-distillation.",
    )
    found.add_argument("kind", choices=("medusa", "eagle", "eagle3"), help="which drafter to train")
    found.add_argument(
        "--model",
        default="default",
        help="model directory, .gguf file, or 'default' (the bundled SmolLM2-135M-Instruct)",
    )
    found.add_argument("--minutes", type=float, default=DEFAULT_MINUTES, help="training wall-clock budget")
    found.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: ~/.cache/patchbay/drafters/<model-id>/<kind>)",
    )
    data = found.add_argument_group("corpus (the target's own generations)")
    data.add_argument("--sequences", type=int, default=256, help="prompts to generate from")
    data.add_argument("--max-new-tokens", type=int, default=96)
    data.add_argument("--temperature", type=float, default=0.0, help="0: greedy generation")
    data.add_argument("--generation-batch-size", type=int, default=32)
    data.add_argument("--eval-fraction", type=float, default=0.1, help="sequences held out to measure acceptance")
    data.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="corpus file to reuse or create (default: cached next to the drafters)",
    )
    data.add_argument("--regenerate", action="store_true", help="generate the corpus even if a cached one exists")
    training = found.add_argument_group("training")
    training.add_argument("--lr", type=float, default=1e-3)
    training.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="examples per step (default: 128 drafting points for medusa, 4 sequences for eagle*)",
    )
    training.add_argument("--max-steps", type=int, default=None, help="stop after this many steps even with time left")
    training.add_argument(
        "--num-drafts", type=int, default=3, help="draft length measured (and medusa's number of heads)"
    )
    training.add_argument(
        "--draft-vocab",
        type=int,
        default=16384,
        help="tokens the drafter may propose: the target's most frequent in the corpus (0: all)",
    )
    training.add_argument("--num-layers", type=int, default=1, help="medusa: residual blocks per head")
    training.add_argument("--unroll", type=int, default=3, help="eagle*: drafting steps unrolled in training")
    training.add_argument("--feature-noise", type=float, default=0.05, help="eagle*: uniform noise on input features")
    training.add_argument("--token-weight", type=float, default=0.5, help="eagle*: weight of the token loss")
    training.add_argument(
        "--aux-layers",
        type=int,
        nargs="+",
        default=None,
        help="eagle3: target layers it reads (default: 2, L // 2, L - 3 of the target's L)",
    )
    training.add_argument(
        "--aux-sequences",
        type=int,
        default=None,
        help="eagle3: training sequences to compute those layers for (default: all; a pass over "
        "the corpus costs about as much as generating it)",
    )
    found.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    found.add_argument("--seed", type=int, default=0)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``patchbay-train-drafter``; returns the process exit status."""
    args = parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {message}", file=sys.stderr, flush=True)

    model, tokenizer = load_target(args.model)
    corpus = corpus_for(args, model, tokenizer, log)
    train_set, held_out = corpus.split(args.eval_fraction)
    if args.kind == "eagle3":
        train_set, held_out = with_aux(args, model, corpus, train_set, held_out, log)
    log(
        f"corpus: {len(train_set)} training and {len(held_out)} held-out sequences, "
        f"{sum(len(t) for t in corpus.token_ids)} tokens"
    )
    module, config, report = train(args, model, train_set, held_out, log)

    from patchbay.plugins.spec_decode.heads import default_drafter_dir, model_id, save_drafter, target_identity

    out = args.out or default_drafter_dir(model_id(model), args.kind)
    config["target"] = target_identity(model)
    config["training"] = {
        **report.as_dict(),
        "corpus": {**corpus.info, "sequences": len(corpus)},
        "minutes": args.minutes,
    }
    save_drafter(out, config, module)
    print(
        f"{args.kind}: {report.steps} steps in {report.seconds:.0f} s, loss {report.first_loss:.3f} -> "
        f"{report.last_loss:.3f}"
    )
    print(f"before training: {report.before.describe()}")
    print(f"after training:  {report.after.describe()}")
    print(f"saved to {out}")
    print("use it with: spec_decode: " + json.dumps({"name": args.kind, "options": {"path": str(out)}}))
    return 0


def load_target(model_path: str) -> tuple[Any, Any]:
    """The target as a plain transformers model (float32, frozen) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from patchbay.toolkit.model_files import resolve_model_dir

    model_dir = resolve_model_dir(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(model_dir)


def corpus_path(args: argparse.Namespace, model: Any) -> Path:
    """``--corpus``, or the cached corpus of these generation settings next to the model's drafters."""
    from patchbay.plugins.spec_decode.heads import default_drafter_dir, model_id

    return args.corpus or default_drafter_dir(model_id(model), "corpus").with_name(
        f"corpus-{args.sequences}x{args.max_new_tokens}-t{args.temperature:g}-s{args.seed}.pt"
    )


def corpus_for(args: argparse.Namespace, model: Any, tokenizer: Any, log: Any) -> Any:
    """Load the cached corpus for these generation settings, or generate (and cache) it."""
    from patchbay.plugins.spec_decode.train import Corpus, build_prompts, generate_corpus

    path = corpus_path(args, model)
    if path.is_file() and not args.regenerate:
        log(f"reusing the corpus {path}")
        return Corpus.load(path)
    prompts = build_prompts(tokenizer, args.sequences, seed=args.seed)
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    eos_ids = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
    log(f"generating {len(prompts)} sequences of up to {args.max_new_tokens} tokens")
    corpus = generate_corpus(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=eos_ids,
        batch_size=args.generation_batch_size,
        temperature=args.temperature,
        seed=args.seed,
        log=log,
    )
    corpus.save(path)
    log(f"saved the corpus to {path}")
    return corpus


def with_aux(
    args: argparse.Namespace, model: Any, corpus: Any, train_set: Any, held_out: Any, log: Any
) -> tuple[Any, Any]:
    """(train, held-out) with the aux layers' outputs: ``--aux-sequences`` training sequences, all held-out ones."""
    from patchbay.interfaces.drafter import resolve_aux_layers
    from patchbay.plugins.spec_decode.heads import default_aux_layers, text_config
    from patchbay.plugins.spec_decode.train import Corpus, add_aux_hidden_states

    num_layers = text_config(model).num_hidden_layers
    layers = (
        default_aux_layers(num_layers)
        if args.aux_layers is None
        else resolve_aux_layers(args.aux_layers, num_layers, drafter="eagle3")
    )
    num_train = len(train_set) if args.aux_sequences is None else min(args.aux_sequences, len(train_set))
    path = corpus_path(args, model).with_suffix("")
    path = path.with_name(f"{path.name}-aux{'-'.join(map(str, layers))}-train{num_train}-eval{len(held_out)}.pt")
    if path.is_file() and not args.regenerate:
        log(f"reusing the aux hidden states {path}")
        both = Corpus.load(path)
    else:
        log(
            f"computing the outputs of layers {layers} over {num_train} training and {len(held_out)} held-out sequences"
        )
        both = add_aux_hidden_states(
            model,
            Corpus(
                train_set.token_ids[:num_train] + held_out.token_ids,
                train_set.hidden[:num_train] + held_out.hidden,
                train_set.next_token_ids[:num_train] + held_out.next_token_ids,
                train_set.prompt_lens[:num_train] + held_out.prompt_lens,
                corpus.info,
            ),
            layers,
            log=log,
        )
        both.save(path)
    return both.subset(range(num_train)), both.subset(range(num_train, len(both)))


def train(args: argparse.Namespace, model: Any, train_set: Any, held_out: Any, log: Any) -> tuple[Any, dict, Any]:
    """Train the chosen drafter; returns (module, config without target/training, report)."""
    from patchbay.plugins.spec_decode.heads import Eagle3DraftModel, EagleDraftModel, MedusaHeads, target_parts
    from patchbay.plugins.spec_decode.train import draft_token_map, train_eagle, train_medusa

    parts = target_parts(model)
    seconds = args.minutes * 60
    token_map = draft_token_map(train_set, args.draft_vocab, parts.vocab_size)
    draft_vocab_size = None if token_map is None else len(token_map)
    vocab_note = f"a draft vocabulary of {draft_vocab_size} tokens" if token_map is not None else "the full vocabulary"
    if args.kind == "medusa":
        heads = MedusaHeads(parts.hidden_size, args.num_drafts, args.num_layers, draft_vocab_size)
        if token_map is not None:
            assert heads.token_map is not None  # a draft vocabulary size registers the buffer
            heads.token_map.copy_(token_map)
        log(f"training {args.num_drafts} medusa heads over {vocab_note} for {args.minutes:g} minutes")
        report = train_medusa(
            heads,
            parts,
            train_set,
            held_out,
            seconds=seconds,
            lr=args.lr,
            batch_size=args.batch_size or 128,
            max_steps=args.max_steps,
            seed=args.seed,
            log=log,
        )
        config = {
            "kind": "medusa",
            "num_heads": heads.num_heads,
            "num_layers": args.num_layers,
            "draft_vocab_size": draft_vocab_size,
            "hidden_size": parts.hidden_size,
            "vocab_size": parts.vocab_size,
        }
        return heads, config, report
    if args.kind == "eagle3":
        draft: EagleDraftModel = Eagle3DraftModel.for_target(
            parts, draft_vocab_size=draft_vocab_size, aux_layers=train_set.info["aux_layers"]
        )
    else:
        draft = EagleDraftModel.for_target(parts, draft_vocab_size=draft_vocab_size)
    if token_map is not None:
        assert draft.token_map is not None  # a draft vocabulary size registers the buffer
        draft.token_map.copy_(token_map)
    log(
        f"training the {args.kind} layer ({sum(p.numel() for p in draft.parameters()) / 1e6:.1f} M parameters) "
        f"over {vocab_note} for {args.minutes:g} minutes"
    )
    report = train_eagle(
        draft,
        parts,
        train_set,
        held_out,
        seconds=seconds,
        num_steps=args.unroll,
        num_drafts=args.num_drafts,
        lr=args.lr,
        batch_size=args.batch_size or 4,
        feature_noise=args.feature_noise,
        token_weight=args.token_weight,
        max_steps=args.max_steps,
        seed=args.seed,
        log=log,
    )
    config = {"kind": args.kind, **draft.sizes(), "vocab_size": parts.vocab_size}
    return draft, config, report


if __name__ == "__main__":
    raise SystemExit(main())
