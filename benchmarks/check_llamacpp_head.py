"""Check: llama.cpp's own converter reads the feature layers ogspo writes into a head's config.json.

    PATH=.venv/bin:$PATH python benchmarks/check_llamacpp_head.py --model results/quick/model

Builds an ogspo head for the prepared model with non-default feature layers (random weights: only the
format is checked), writes it in EAGLE-3's format, converts it with llama.cpp's `convert_hf_to_gguf.py`
(the pinned source of `llamacpp.py`, cached under ~/.cache/ogspo/peers, and the converter's venv; the
first run downloads them) and compares the GGUF's `target_layers` with the top-level
`eagle_aux_hidden_state_layer_ids`. `make test` runs the same check through the project's own python
(tests/test_eagle3.py); this script uses the converter's venv, as bench_peers does. Prints one line; exit
status 1 when they differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from llamacpp import VERSION, convert_to_gguf, llama_cpp_source  # noqa: E402

from ogspo.drafter.eagle3 import CONFIG, save_eagle3  # noqa: E402
from ogspo.drafter.head import EagleHead, HeadConfig  # noqa: E402
from ogspo.engine.model import load_target  # noqa: E402


def converted_target_layers(model_dir: Path, work: Path, *, python: Path | None = None) -> tuple[list[int], dict]:
    """An ogspo head for the prepared target `model_dir` with non-default feature layers (random
    weights: only the format is checked), written in EAGLE-3's format under `work` and converted by
    llama.cpp's own `convert_hf_to_gguf.py` (`python`: the interpreter that runs it; None: the
    converter's venv). Returns the GGUF's `<arch>.target_layers` and the config.json written."""
    model, _ = load_target(model_dir)
    n = model.config.num_hidden_layers
    cfg = HeadConfig.for_target(model, draft_vocab=256)
    layers = (1, n // 3, n - 5)  # outputs of these layers: not the default ids (2, N/2, N-3) entering layers
    cfg = dataclasses.replace(cfg, feature_layers=layers)
    d2t = torch.arange(cfg.draft_vocab)
    head = EagleHead(cfg, embed=model.get_input_embeddings().weight, lm_rows=model.get_output_embeddings().weight[d2t], d2t=d2t)
    folder = work / "head"
    folder.mkdir(parents=True)
    save_eagle3(head, folder, target_config=model.config)
    written = json.loads((folder / CONFIG).read_text())
    gguf = convert_to_gguf(folder, work / "head.gguf", outtype="f32", src_root=llama_cpp_source(), target_dir=model_dir,
                           python=python)
    fields = GGUFReader(str(gguf)).fields
    key = next(k for k in fields if k.endswith(".target_layers"))
    return [int(x) for x in fields[key].contents()], written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("results/quick/model"), help="prepared model folder (the target)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got, written = converted_target_layers(args.model, Path(tmp))
    want = written["eagle_aux_hidden_state_layer_ids"]
    same = got == want
    print(f"llama.cpp {VERSION} converter: target_layers = {got}, config.json eagle_aux_hidden_state_layer_ids = {want} "
          f"(eagle_config's SGLang copy {written['eagle_config']['eagle_aux_hidden_state_layer_ids']}): "
          f"{'equal' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
