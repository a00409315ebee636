"""Rebuild the optional real data (tau2-telecom, tot-game24) from its public sources: docs/DATA.md.

    python tools/get_shared_data.py [--output ../shared/data] [--source DIR] [--only tau2-telecom|tot-game24]

Downloads the upstream files (pinned commits of two MIT-licensed GitHub repositories) and converts
them into the chat-JSONL shape the tests and benchmarks read, one trajectory a line:
``{"group_id", "trial", "messages", "reward"}``, each data set with its LICENSE beside it. The
result equals the ``../shared/data`` files line for line. ``--source DIR`` reads the upstream files
from DIR instead (the repositories' paths below DIR, e.g. a checkout), for machines without network.
Never run by the tests. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import os
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAW = "https://raw.githubusercontent.com/{repo}/{commit}/{path}"

TAU2 = {
    "repo": "sierra-research/tau2-bench",
    "commit": "5ff9a6cdfb107ef339a2dcfdd5fe1c74cdd4eb23",  # branch feature/gym; the file was removed after it
    "results": "data/experiments/test_run_1/gpt-4.1-2025-04-14_telecom_no-user_gpt-4.1-2025-04-14_4trials_5tasks.json",
    "license": "LICENSE",
}
GAME24 = {
    "repo": "princeton-nlp/tree-of-thought-llm",
    "commit": "ab400345c5ea39d28ea6d7d3be0e417b11113c87",
    "log": "logs/game24/gpt-4_0.7_naive_cot_sample_100_start900_end1000.json",
    "puzzles": "src/tot/data/24/24.csv",
    "prompts": "src/tot/prompts/game24.py",
    "license": "LICENSE",
}


class SourceError(Exception):
    """An upstream file missing or not in the expected shape."""


def locate(spec: dict, key: str, source: Path | None) -> Path | str:
    """Where one upstream file is read from: ``source / repo / path`` or ``source / path`` if
    ``source`` is given (the first that exists), else its URL."""
    path = spec[key]
    if source is not None:
        for candidate in (source / spec["repo"] / path, source / path):
            if candidate.is_file():
                return candidate
        raise SourceError(f"{source / path}: no such file (nor {source / spec['repo'] / path})")
    return RAW.format(repo=spec["repo"], commit=spec["commit"], path=path)


def fetch(spec: dict, key: str, source: Path | None) -> bytes:
    """One upstream file: from ``source / repo / path`` or ``source / path`` if given, else downloaded."""
    url = locate(spec, key, source)
    if isinstance(url, Path):
        return url.read_bytes()
    print(f"downloading {url}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            return response.read()
    except OSError as error:
        raise SourceError(f"{url}: {error}") from error


def fetch_text(spec: dict, key: str, source: Path | None) -> str:
    """An upstream text file, decoded as UTF-8; a bad byte is a :class:`SourceError` naming the file."""
    data = fetch(spec, key, source)
    try:
        return data.decode()
    except UnicodeDecodeError as error:
        where = locate(spec, key, source)
        raise SourceError(
            f"{where}: not UTF-8 text (byte 0x{data[error.start]:02x} at byte {error.start + 1})"
        ) from None


def fetch_json(spec: dict, key: str, source: Path | None) -> object:
    """An upstream JSON file, parsed; malformed JSON is a :class:`SourceError` naming the file, line and column."""
    text = fetch_text(spec, key, source)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = locate(spec, key, source)
        raise SourceError(f"{where}:{error.lineno}: malformed JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise SourceError(f"{locate(spec, key, source)}: JSON nested too deeply to read") from None


def tau2_records(results: dict) -> list[dict]:
    """tau2-bench results -> one chat trajectory per simulation: the domain policy as system prompt,
    the task's ticket as the user turn, then the agent's messages with OpenAI-style tool calls."""
    try:
        tickets = {task["id"]: task["ticket"] for task in results["tasks"]}
        policy = results["info"]["environment_info"]["policy"]
        records = []
        for simulation in results["simulations"]:
            messages = [
                {"role": "system", "content": policy},
                {"role": "user", "content": tickets[simulation["task_id"]]},
            ]
            for message in simulation["messages"]:
                if message["role"] == "tool":
                    messages.append({"role": "tool", "tool_call_id": message["id"], "content": message["content"]})
                    continue
                entry = {"role": message["role"], "content": message.get("content")}
                if message.get("tool_calls"):
                    entry["tool_calls"] = [
                        {
                            "id": call["id"],
                            "type": "function",
                            "function": {
                                "name": call["name"],
                                "arguments": json.dumps(call["arguments"], sort_keys=True),
                            },
                        }
                        for call in message["tool_calls"]
                    ]
                messages.append(entry)
            reward = simulation["reward_info"]["reward"]
            records.append(
                {
                    "group_id": simulation["task_id"],
                    "trial": simulation["trial"],
                    "messages": messages,
                    "reward": reward,
                }
            )
    except (KeyError, TypeError) as error:
        raise SourceError(f"tau2 results: unexpected shape ({error!r} missing or wrong)") from error
    return records


def cot_template(prompts_source: str) -> str:
    """The ``cot_prompt`` string of tree-of-thought-llm's prompts module, read without executing it."""
    for node in ast.parse(prompts_source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "cot_prompt" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SourceError("game24 prompts: no cot_prompt assignment")


def game24_records(log: list, puzzles_csv: str, template: str) -> list[dict]:
    """tree-of-thought-llm CoT samples -> one chat trajectory per answer: the 5-shot CoT prompt of the
    puzzle (row ``idx`` of 24.csv) and the sampled answer, reward 1.0/0.0 as the log scored it."""
    puzzles = [row["Puzzles"] for row in csv.DictReader(io.StringIO(puzzles_csv))]
    records = []
    try:
        for entry in log:
            prompt = template.format(input=puzzles[entry["idx"]])
            for trial, (answer, info) in enumerate(zip(entry["ys"], entry["infos"], strict=True)):
                messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
                records.append(
                    {
                        "group_id": f"game24-{entry['idx']}",
                        "trial": trial,
                        "messages": messages,
                        "reward": float(info["r"]),
                    }
                )
    except (KeyError, TypeError, IndexError, ValueError) as error:
        raise SourceError(f"game24 log: unexpected shape ({error!r})") from error
    return records


def write(folder: Path, name: str, records: list[dict], license_text: bytes) -> Path:
    """``folder/name`` (JSONL) and ``folder/LICENSE``, each written whole or not at all."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    for path, data in (
        (folder / "LICENSE", license_text),
        (target, "".join(json.dumps(r) + "\n" for r in records).encode()),
    ):
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(data)
        os.replace(partial, path)
    return target


def build(name: str, output: Path, source: Path | None) -> Path:
    if name == "tau2-telecom":
        results = fetch_json(TAU2, "results", source)
        return write(output / name, "trials.jsonl", tau2_records(results), fetch(TAU2, "license", source))
    log = fetch_json(GAME24, "log", source)
    template = cot_template(fetch_text(GAME24, "prompts", source))
    records = game24_records(log, fetch_text(GAME24, "puzzles", source), template)
    return write(output / name, "samples.jsonl", records, fetch(GAME24, "license", source))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output", type=Path, default=ROOT.parent / "shared" / "data",
        help="folder that gets tau2-telecom/ and tot-game24/ (default: ../shared/data beside the repository, "
        "where the tests and benchmarks look)",
    )  # fmt: skip
    parser.add_argument("--source", type=Path, help="read the upstream files from this folder instead of downloading")
    parser.add_argument("--only", choices=("tau2-telecom", "tot-game24"), help="build one data set")
    args = parser.parse_args(argv)
    try:
        for name in [args.only] if args.only else ["tau2-telecom", "tot-game24"]:
            print(f"wrote {build(name, args.output, args.source)}")
    except (SourceError, OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
