"""What several test files share, and nothing else: tiny configs and tolerances (tiny), ranks in fresh
processes (spawn), the single-process reference (reference), the CLI as a subprocess (cli), data made
here (corpus, chat, documents) and JSON mutations for the fuzzers (mutate). A test file imports from
here, never from another test file (conftest.py's shared spawns are the one exception: they run
jobs two test files define)."""
