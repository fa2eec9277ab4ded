"""The archive: settled runs past their retention, moved out of the hot tables into content-addressed segment files
that still verify as part of their tenant's audit chain (docs/archive.md).

store.py reaches the directory or bucket the deployer named; segments.py writes and reads one segment; retention.py
decides which runs may go; service.py archives them and sets legal holds; reader.py reads an archived run back;
chain.py gives `verify_chain` the archived part of a chain.
"""
