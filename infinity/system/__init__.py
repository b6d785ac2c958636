"""What the machine gives: the native library's loader (native.py, also
importable as ``infinity.native``), memory and cgroup facts (sysinfo.py) and
signal handling (signals.py).

Owns: facts about this process and machine, read fresh when asked. May import:
config/.
"""
