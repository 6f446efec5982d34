"""The in-script runtime: what a training script calls once a launcher has started it.

Nothing is imported here so that ``import disttrain`` stays cheap; ``disttrain/__init__``
exports the public names lazily from the modules of this package.
"""
