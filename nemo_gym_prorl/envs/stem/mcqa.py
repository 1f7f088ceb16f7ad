"""Multiple-choice grading on NeMo Gym's ``mcqa`` row schema, with the answer-reading modes Gym's servers have.

A row: ``options`` (one-key dicts, any number), ``expected_answer`` (a letter), ``grading_mode`` and optionally
``template_metadata.output_regex``, tried first. Modes: ``strict_single_letter_boxed``, ``lenient_boxed``,
``lenient_answer_colon``, ``lenient_answer_colon_md``, ``boxed_or_answer_colon`` (Gym's gpqa_diamond) and
``choice_tag_or_answer`` (Gym's bunsenbench_chemistry_mcq). The reasoning trace is never read; a letter outside the
options is no answer; option text matches with case ignored unless two options differ only in case.

Design notes (how each mode reads a reply): docs/code-and-stem.md#envsstemmcqapy
"""

from __future__ import annotations

import html
import re
import unicodedata
from typing import Any, Literal

from nemo_gym_prorl.envs.math.env import strip_reasoning

GradingMode = Literal[
    "strict_single_letter_boxed", "lenient_boxed", "lenient_answer_colon", "lenient_answer_colon_md",
    "boxed_or_answer_colon", "choice_tag_or_answer",
]  # fmt: skip

_TEXT_WRAPPER = re.compile(r"\\text\{\s*(.*?)\s*\}", re.DOTALL)
_LETTER_ALONE = re.compile(r"[^A-Za-z]*([A-Z])[^A-Za-z]*")
_LETTER_THEN_LABEL = re.compile(r"\s*([A-Z])\s*[:).\-]")
_FIRST_ANSWER = re.compile(r"answer\s*:\s*(.+)", re.IGNORECASE)
_MD_ANSWER = re.compile(r"[*_]{0,2}answer[*_]{0,2}\s*:[*_\s]{0,2}(.+)", re.IGNORECASE | re.MULTILINE)
_GPQA_ANSWER = re.compile(r"[*_]{0,2}answer[*_]{0,2}\s*:[\s*_]{0,2}\s*([A-Z])(?![a-zA-Z0-9])", re.IGNORECASE)
_STANDALONE_CAPITAL = re.compile(r"\b[A-Z]\b")
_CHOICE_LIST = re.compile(r"\b([A-Za-z])\b(?:\s*[/|&,;]\s*|\s+(?:or|and)\s+|\s+)\b([A-Za-z])\b", re.IGNORECASE)
# bunsenbench_chemistry_mcq's reading, its patterns as Gym writes them
_TAGGED = re.compile(
    r"<\s*(answer|choice|response|final_answer|final-answer)\b[^>]*>\s*(.*?)\s*<\s*/\s*\1\s*>",
    re.IGNORECASE | re.DOTALL,
)
_CHOICES_LIST = re.compile(r"<\s*choices\b[^>]*>.*?<\s*/\s*choices\s*>", re.IGNORECASE | re.DOTALL)
_BOX_OPEN = re.compile(r"\\boxed\s*\{")
_ANSWER_STATEMENTS = [
    re.compile(r"(?im)^\s*(?:(?:[-*•]|\d+[.)])\s*)?(?:\*\*)?answer(?:\*\*)?\s*:\s*(.+?)\s*$"),
    re.compile(r"(?is)(?:\*\*)?answer(?:\*\*)?\s*:\s*(.+?)(?=$|[\r\n])"),
    re.compile(r"(?is)(?:the\s+(?:correct\s+)?answer\s+is|my\s+answer\s+is|i\s+(?:choose|select))\s+(.+?)(?:\n|$)"),
]
_LETTER_FORMS = [  # "Option B", "B) text", "(B)"
    re.compile(r"(?:option|choice)\s+([A-Z])\s*[)\].:]?", re.IGNORECASE),
    re.compile(r"([A-Z])[)\].:](?:\s.*)?", re.IGNORECASE | re.DOTALL),
    re.compile(r"[^A-Za-z]*([A-Za-z])[^A-Za-z]*"),
]
_LATEX_WRAPPER = re.compile(r"\\(?:text|mathrm|operatorname)\{\s*(.*?)\s*\}", re.DOTALL)
_BOXED_WHOLE = re.compile(r"\\boxed\{\s*(.*?)\s*\}", re.DOTALL)
_QUOTES = " \t\r\n`*_\"'"
# look-alikes Gym maps beyond what NFKC does: dashes, times signs, dots, micro, slashes
_CHEMISTRY_CHARACTERS = str.maketrans("−–—‒‑×✕·∙⋅•µμ⁄∕", "-----xx....uu//")


def option_letters(options: list[dict[str, Any]] | None) -> dict[str, str]:
    """{letter: option text} of the options that have text."""
    letters: dict[str, str] = {}
    for option in options or []:
        for key, text in option.items():
            if isinstance(key, str) and len(key) == 1 and key.isalpha() and text is not None:
                letters[key.upper()] = str(text)
    return letters


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None when there is none or it never closes."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
    return None


def _unwrap_text(s: str) -> str:
    while (m := _TEXT_WRAPPER.fullmatch(s)) is not None:
        s = m.group(1)
    return s


def _squash(s: str, fold_case: bool = True) -> str:
    s = " ".join(s.split())
    return s.lower() if fold_case else s


def _option_named(candidates: list[str], letters: dict[str, str], contains: bool) -> str | None:
    """The one option the candidates name: equal to its text, or with `contains` holding it, spacing ignored. Case
    is ignored (Gym's mcqa lowercases) unless the options it finds differ only in case: chemistry's ``CO`` (carbon
    monoxide) and ``Co`` (cobalt) are told apart by case alone, so there case decides."""

    def named(fold_case: bool) -> set[str]:
        texts = [_squash(c, fold_case) for c in candidates]
        options = {letter: _squash(option, fold_case) for letter, option in letters.items()}
        return {letter for letter, o in options.items() if o and any(o in t if contains else o == t for t in texts)}

    found = named(fold_case=True)
    if len(found) > 1 and len({_squash(letters[letter]) for letter in found}) == 1:
        found = named(fold_case=False)
    return found.pop() if len(found) == 1 else None


def _boxed_letter(text: str, letters: dict[str, str]) -> str | None:
    inner = last_boxed(text)
    if inner is None:
        return None
    inner = _unwrap_text(inner.strip())
    m = _LETTER_ALONE.fullmatch(inner) or _LETTER_THEN_LABEL.match(inner)
    letter = m.group(1).upper() if m else None
    return letter if letter in letters else None


def _boxed_option_text(text: str, letters: dict[str, str]) -> str | None:
    inner = last_boxed(text)
    if inner is None:
        return None
    inner = inner.strip()
    return _option_named([inner, _unwrap_text(inner)], letters, contains=True)


def _first_answer_colon(text: str, letters: dict[str, str]) -> str | None:
    m = _FIRST_ANSWER.search(text)
    if m is None:
        return None
    candidate = _unwrap_text(m.group(1)).strip()
    if len(candidate) == 1 and candidate.upper() in letters:
        return candidate.upper()
    return _option_named([candidate], letters, contains=False)


def _letter_in_payload(payload: str, letters: dict[str, str]) -> str | None:
    candidate = unicodedata.normalize("NFKC", payload).strip().strip("*_` \t\r\n.,;:")
    for m in _CHOICE_LIST.finditer(candidate):
        if {m.group(1).upper(), m.group(2).upper()} <= letters.keys() and m.group(1).upper() != m.group(2).upper():
            return None
    if len(candidate) == 1:
        letter = candidate
    elif (lead := re.match(r"([A-Za-z])(?![A-Za-z0-9])", candidate)) is not None:
        letter = lead.group(1)
    else:
        capitals = _STANDALONE_CAPITAL.findall(candidate)
        letter = capitals[-1] if capitals else ""
    return letter.upper() if letter.upper() in letters else None


def _last_answer_payload(text: str, letters: dict[str, str], prefix: str | None) -> str | None:
    text = unicodedata.normalize("NFKC", text)
    found = [(m.start(), m.group(1)) for m in _MD_ANSWER.finditer(text)]
    if prefix:
        for m in re.finditer(re.escape(unicodedata.normalize("NFKC", prefix)) + r"\s*", text, re.IGNORECASE):
            found.append((m.start(), text[m.end() :].split("\n", 1)[0]))
    for _, payload in sorted(found, reverse=True):
        return _letter_in_payload(payload, letters)
    return None


def _gpqa_letter(text: str, letters: dict[str, str]) -> str | None:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", text)
    letter = None
    if boxed:
        inner = boxed[-1].strip()
        capitals = [inner] if len(inner) == 1 and inner.isupper() else _STANDALONE_CAPITAL.findall(inner)
        letter = capitals[-1] if capitals else None
    if letter is None and (answers := _GPQA_ANSWER.findall(text)):
        letter = answers[-1].upper()
    return letter if letter is not None and (not letters or letter in letters) else None


def _boxes(text: str) -> list[tuple[int, str]]:
    """Every ``\\boxed{}`` with its offset, braces balanced and escaped characters skipped; none after one left open."""
    found: list[tuple[int, str]] = []
    position = 0
    while (opening := _BOX_OPEN.search(text, position)) is not None:
        depth, i = 1, opening.end()
        while i < len(text) and depth:
            if text[i] == "\\":
                i += 2
                continue
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth:
            return found
        found.append((opening.start(), text[opening.end() : i - 1]))
        position = i
    return found


def _answer_statements(text: str) -> list[tuple[int, str]]:
    """What a reply states as its answer, each with its offset: tags, boxes, ``Answer:`` lines, "the answer is"."""
    listed = [m.span() for m in _CHOICES_LIST.finditer(text)]
    found = [(m.start(), m.group(2)) for m in _TAGGED.finditer(text)
             if m.group(1).lower() != "choice" or not any(a <= m.start() < b for a, b in listed)]  # fmt: skip
    found += _boxes(text)
    found += [(m.start(), m.group(1)) for pattern in _ANSWER_STATEMENTS for m in pattern.finditer(text)]
    return found


def _chemistry_text(text: str) -> str:
    """Text as bunsenbench compares it: entities decoded, ``₂`` as ``2``, dashes and dots alike, case kept."""
    text = unicodedata.normalize("NFKC", html.unescape(text)).translate(_CHEMISTRY_CHARACTERS)
    return " ".join("".join(c for c in text if unicodedata.category(c) != "Cf").split())


def _unwrap_statement(candidate: str) -> str:
    """A statement without the quotes, box, ``\\text{}`` and brackets around it."""
    candidate = candidate.strip(_QUOTES)
    if (boxed := _BOXED_WHOLE.fullmatch(candidate)) is not None:
        candidate = boxed.group(1).strip()
    while (wrapped := _LATEX_WRAPPER.fullmatch(candidate)) is not None:
        candidate = wrapped.group(1).strip()
    while len(candidate) >= 2 and candidate[0] in "([{\"'<" and candidate[-1] in ")]}\"'>":
        candidate = candidate[1:-1].strip(_QUOTES)
    return candidate.strip(_QUOTES + ".;,")


def _statement_choice(candidate: str, letters: dict[str, str]) -> str | None:
    """The option a statement names: as a letter, else by its exact text; then the same without its wrappers."""
    for form in (candidate.strip(), _unwrap_statement(candidate.strip())):
        if not form:
            return None
        for pattern in _LETTER_FORMS:
            if (m := pattern.fullmatch(form)) is not None and m.group(1).upper() in letters:
                return m.group(1).upper()
        wanted = _chemistry_text(form)
        if (letter := next((k for k, option in letters.items() if _chemistry_text(option) == wanted), None)):
            return letter
    return None


def _tagged_choice(text: str, letters: dict[str, str]) -> str | None:
    """The last answer statement that names an option, else the last line if it names one, else the first."""
    statements = [candidate for _, candidate in sorted(_answer_statements(text), reverse=True)]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for candidate in statements + lines[-1:] + lines[:1]:
        if (letter := _statement_choice(candidate, letters)) is not None:
            return letter
    return None


def _custom_regex(text: str, patterns: str | list[str], letters: dict[str, str]) -> str | None:
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        try:
            matches = re.findall(pattern, text, re.IGNORECASE)
        except re.error:
            continue
        if not matches:
            continue
        last = matches[-1] if isinstance(matches[-1], str) else matches[-1][0]
        captured = unicodedata.normalize("NFKC", last.strip())
        if len(captured) == 1 and captured.isalpha():
            return captured.upper()
        if (letter := _option_named([captured], letters, contains=False)) is not None:
            return letter
    return None


def read_choice(text: str, row: dict[str, Any], mode: GradingMode) -> str | None:
    """The option letter a reply chose, read as `mode` (and the row's template regex) says; None for none. The
    reply's reasoning trace is never read: a letter in it is no choice."""
    text = strip_reasoning(text)
    letters = option_letters(row.get("options"))
    template = row.get("template_metadata") or {}
    if "output_regex" in template and (letter := _custom_regex(text, template["output_regex"], letters)):
        return letter
    if mode == "strict_single_letter_boxed":
        return _boxed_letter(text, letters)
    if mode == "lenient_boxed":
        return _boxed_letter(text, letters) or _boxed_option_text(text, letters)
    if mode == "lenient_answer_colon":
        return _first_answer_colon(text, letters)
    if mode == "lenient_answer_colon_md":
        prefix = template.get("answer_prefix")
        letter = _last_answer_payload(text, letters, prefix)
        return letter if letter is not None or not prefix else _boxed_letter(text, letters)
    if mode == "choice_tag_or_answer":
        return _tagged_choice(text, letters)
    return _gpqa_letter(text, letters)
