"""Where an engine rank's weights come from: the disk, or the weight cache daemon (with a lease).

``registry.LOADERS`` names every ``--load-format``; each is a ``base.WeightLoader`` whose ``load``
returns ``base.LoadedWeights``: the tensors, a report of the load, and (zero_copy) the
``lease.CacheLease`` that keeps the daemon's memory mapped. Nothing is re-exported here.
"""
