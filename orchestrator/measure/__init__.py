"""Measurement tools: specdec bench, eval, profile-draft and trace-report, and their built-in prompt set (data/prompts.jsonl). Imports the product; the product never imports this package."""


def md_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table: the head, the separator and one line per row, each ending in a newline."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows]) + "\n"
