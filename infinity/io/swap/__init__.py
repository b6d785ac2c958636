"""The swap store: tensors in swap files over one or more directories,
striped, checksummed, O_DIRECT (store.py, the public :class:`SwapStore`).

The other files are its private parts, shared only inside this folder: the
swap folder and its ownership (dir.py), one path's file and extents (path.py),
the index of entries and pieces (layout.py), transfers through the staging
pool (transfer.py), checksums (sums.py) and the handle a caller waits on
(handle.py). May import: io/ (engine, errors, host pool, extent allocator) and
system/.
"""
