"""Can the project's vLLM serve a tiny vision-language model with an image? A manual check (docs/MODELS.md,
"vLLM with images"); it starts and stops one server.

    python tools/vllm_vision_check.py --family qwen2_5_vl --output DIR [--side 56] [--python VLLM_PYTHON]

Builds the family's tiny random-init model (``configs/models/tiny_<family>.json`` with attention head dim 32:
vLLM's CPU attention refuses smaller ones), saves it with the processor folder of ``ds-tree make-tokenizer
--vision FAMILY``, starts it as a run would (:class:`~ds_tree.sampling.vllm.VLLMServer`: float32,
``--enforce-eager``, prefix caching), sends one chat request with a ``side`` x ``side`` random PNG as a
base64 data URL (8 greedy tokens, prompt log-probs), and compares vLLM's log-probs with transformers'
forward from the same ids and the family's image processor. Prints what fails, or the differences.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
HEAD_DIM_32 = {  # text shape with head dim 32; the multimodal rotary sections sum to head_dim / 2
    "qwen2_5_vl": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2),
    "qwen3_vl": dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32),
}
SECTIONS = {"qwen2_5_vl": [4, 6, 6], "qwen3_vl": [6, 5, 5]}


def build_model_dir(family: str, output: Path) -> Path:
    """The tiny model with head dim 32 and the family's processor folder, saved in ``output / "model"``."""
    from transformers import AutoModelForImageTextToText

    from ds_tree.models.loading import load_config
    from ds_tree.vocab.vision_processor import save_vision_processor

    source = json.loads((ROOT / f"configs/models/tiny_{family}.json").read_text())
    source["text_config"].update(HEAD_DIM_32[family])
    source["text_config"]["rope_parameters"]["mrope_section"] = SECTIONS[family]
    source["vision_config"]["out_hidden_size"] = HEAD_DIM_32[family]["hidden_size"]  # the merger feeds the text
    output.mkdir(parents=True, exist_ok=True)
    (output / "config.json").write_text(json.dumps(source))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(load_config(str(output / "config.json")), dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(output / "model")
    save_vision_processor(output / "model", family)
    return output / "model"


def chat_request(url: str, image: bytes) -> dict:
    data_url = "data:image/png;base64," + base64.b64encode(image).decode()
    question = {"type": "text", "text": "What is on the screen?"}
    content = [{"type": "image_url", "image_url": {"url": data_url}}, question]
    body = {
        "model": "ds_tree-policy",
        "messages": [{"role": "user", "content": content}],
        **dict(max_tokens=8, temperature=0, logprobs=True, prompt_logprobs=0, return_token_ids=True),
    }
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read().decode())


def compare(family: str, model_dir: Path, pixels: np.ndarray, answer: dict) -> dict:
    """vLLM's prompt and sampled log-probs against transformers' forward on the same ids and image."""
    from transformers import AutoModelForImageTextToText

    from ds_tree.vocab.vision_processor import FAMILIES, build_image_processor

    choice = answer["choices"][0]
    prompt, generated = answer.get("prompt_token_ids") or choice["prompt_token_ids"], choice["token_ids"]
    ids = torch.as_tensor(prompt + generated)[None]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    image = build_image_processor(FAMILIES[family])(images=[pixels], return_tensors="pt")
    marks = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=ids, **image, mm_token_type_ids=marks, use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    vllm_prompt = [next(iter(entry.values()))["logprob"] for entry in answer["prompt_logprobs"][1:]]
    vllm_sampled = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    ours = [float(logp[k - 1, ids[0, k]]) for k in range(1, ids.shape[1])]
    ours_prompt, ours_sampled = ours[: len(prompt) - 1], ours[len(prompt) - 1 :]
    return {
        "image_tokens": int(marks.sum()),
        "grid_thw": [int(v) for v in image["image_grid_thw"][0]],
        "prompt_tokens": len(prompt),
        "prompt_logprob_max_abs_diff": max(abs(a - b) for a, b in zip(vllm_prompt, ours_prompt, strict=True)),
        "sampled_logprob_max_abs_diff": max(abs(a - b) for a, b in zip(vllm_sampled, ours_sampled, strict=True)),
        "greedy_tokens_agree": [int(t) for t in logp[len(prompt) - 1 : -1].argmax(-1)] == generated,
    }


def main() -> None:
    from PIL import Image

    from ds_tree.sampling.vllm import VLLMServer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(HEAD_DIM_32), required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--side", type=int, default=56, help="image side in pixels")
    parser.add_argument("--python", help="vLLM's python (default: the checkout's .venv-vllm)")
    args = parser.parse_args()
    model_dir = build_model_dir(args.family, args.output)
    pixels = (np.random.default_rng(0).random((args.side, args.side, 3)) * 255).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    server = VLLMServer(model_dir, log_path=args.output / "server.log", python=args.python, max_model_len=1024)
    try:
        answer = chat_request(server.start(), png.getvalue())
    except urllib.error.HTTPError as error:
        raise SystemExit(f"HTTP {error.code}: {error.read().decode()[:2000]}") from None
    finally:
        server.stop()
    print(json.dumps(compare(args.family, model_dir, pixels, answer), indent=2))


if __name__ == "__main__":
    main()
