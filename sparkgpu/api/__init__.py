"""What a user calls: the ``@distributed`` decorator, the calls it returns, ``prepare``, and ``spark.gpu``.

The public names are exported from :mod:`sparkgpu` itself; import them from there.
"""
