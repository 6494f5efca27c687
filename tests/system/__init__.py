"""The product as a user runs it: the CLI, the server, processes, signals, cgroups, fuzzers: a failure here is what a user would see."""
