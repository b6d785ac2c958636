"""Holds and moves bytes, deciding nothing: the tiers' budgets and the shared
host pool with its lock and deferred frees (tiers.py), the copy engine with its
streams and tickets (mover.py), NVMe swap homes (nvme.py) and the ZeRO
collectives (zero.py).

May import: engine/plan, engine/faults, engine/stats, io/, system/, config/.
"""
