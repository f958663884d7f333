"""The run dir's mirror on a staging store (``SPARKGPU_STAGING_ROOT`` an fsspec URL): the client
uploads and follows it, each Spark node keeps a scratch copy in step with it, and the nodes' logs
travel through it in bundles. Used by both sides of the launcher; imports none of them."""
