"""Token ids for `sonar-train --hf`: text files through a Hugging Face tokenizer.

    .venv/bin/python scripts/tokenize_hf.py --tokenizer allenai/OLMoE-1B-7B-0924 \\
        --out ids.safetensors notes/*.md

--tokenizer is anything AutoTokenizer.from_pretrained takes (a Hub name, or a local directory
such as the checkpoint's own). Each file is encoded without special tokens and followed by the
tokenizer's EOS token (when it has one), in the order given; the ids go to one 1-D int64 tensor
"input_ids" in a safetensors file (or, for a path not ending in .safetensors, a text file of ids
separated by spaces). sonar-train draws its training windows from that stream and holds out the
tail (--held-out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="Hub name or directory of the tokenizer")
    ap.add_argument("--out", required=True, help="output: .safetensors (input_ids) or a text file of ids")
    ap.add_argument("--no-eos", action="store_true", help="do not put the EOS token after each file")
    ap.add_argument("files", nargs="+", type=Path, help="UTF-8 text files")
    args = ap.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids: list[int] = []
    for f in args.files:
        ids += tok.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)
        if not args.no_eos and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    if args.out.endswith(".safetensors"):
        save_file({"input_ids": torch.tensor(ids, dtype=torch.int64)}, args.out)
    else:
        Path(args.out).write_text(" ".join(map(str, ids)) + "\n")
    print(f"{len(ids)} tokens from {len(args.files)} files (vocabulary {len(tok)}) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
