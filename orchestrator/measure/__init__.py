"""Measurement tools: specdec bench, eval, profile-draft and trace-report, and their built-in prompt set (data/prompts.jsonl). Imports the product; the product never imports this package."""
