"""Model files that follow parc's model convention; shipped as `parc.examples`.

Each file is also usable on its own by path: `parc compile spec.par examples/gpt.py`.
"""
