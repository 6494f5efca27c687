"""Print the README's set-up commands, one per line: the lines of its first ```bash block.
`.ci/run` runs what this prints, so CI proves the commands a user copies, as written."""

import sys
from pathlib import Path

text = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md").read_text()
fence = text.find("```bash\n")
if fence < 0:
    sys.exit("README.md has no ```bash block: its first lines must give the set-up commands")
block = text[fence + len("```bash\n") :].split("```", 1)[0]
commands = [line.strip() for line in block.splitlines() if line.strip()]
if len(commands) != 2 or "smoe chat" not in commands[0] or "pytest" not in commands[1]:
    sys.exit(f"README.md's first block must be the chat command, then the test one: {commands}")
print("\n".join(commands))
