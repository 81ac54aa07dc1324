"""Test harnesses that ship with parc: a pool of forked gloo ranks (pool.py) that
`parc check` and the tests run on, and deliberate faults (faults.py) that prove the
checks and the recovery work."""
