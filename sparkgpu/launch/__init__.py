"""The launcher: from a decorated call on the client to ranks on the workers, and back.

How one call runs, hop by hop (``spark.gpu.train(fn, data=df, ...)`` or ``fn.distributed(...)``
of a ``@distributed`` function), with the module doing each::

    client
     1. spark.gpu.train: checks its arguments, takes this session's    sparkgpu.spark_gpu
        Spark backend; with data=, prepares the job (hops 3-5,
        nothing written), then turns the data into MDS shards on the    sparkgpu.data.convert
        executors (or reads the table in place), adds data_url to the
        prepared arguments and goes on at hop 6 with that same job
     2. .distributed(): the frozen JobSpec, then prepare() runs         sparkgpu.decorator, .spec,
        hops 3-5 once (a dryrun stops there: the plan, nothing          sparkgpu.prepare
        written) and PreparedJob.write() hops 6-7
     3. backend.place (Spark: the GPU pool, whose usage policy is      launch.backends.local,
        checked at once), then backend.resolve: capacity and gpu_type  .spark, .spark_capacity,
        within seconds (Spark: a probe job on the executors)
                                                                       .spark_probe; sparkgpu.pools
     4. callbacks (tracking, metering) and the usage policy            sparkgpu.callbacks,
                                                                       sparkgpu.tracking, .usage
     5. the function, arguments and callbacks pickled                  launch.serialization
     6. with shipping: environment snapshot, staged by content         sparkgpu.env
     7. the run dir written and signed: _air.py, spec.json,            launch.run_dir, .run_layout,
        payload.pkl (+ _hydrate.py, _errors.py), payload.sig;          launch.entrypoint_template,
        the job key kept in this user's keyring                        launch.payload_signature,
                                                                       launch.keys
     8. the supervisor's attempt loop: submit, watch, stream the       launch.supervisor,
        ranks' logs, restart or raise; state.json for `resume` (its    launch.logs, launch.resume,
        job, attempt and node states, the node exit record). The       sparkgpu.protocol
        local backend starts the first agent beside the callbacks'
        before_job (backend.prestart) and hands it their variables
     9. backend.submit: one node agent here, a warm-pool fork (also    launch.backends.local,
        a restart's fork from the job's standby), or one Spark         launch.warm_pool, .pool_zygote,
                                                                       .backends.warm_pool,
        barrier task per node (the run dir mirrored to an object       launch.backends.spark,
        store when the staging root is one); on Spark, lost nodes      launch.staging,
        stop the others and the attempt's report says how each ended   .spark_node_watch
    worker, per node
    10. Spark node task: verify the payload, start the agent, watch    launch.backends.spark_node
        it, beat for the client and the peer nodes
    11. node agent: verify, rendezvous, start the ranks with the       launch.agent,
        verified _air.py text, record how each exits                   launch.rendezvous,
                                                                       launch.rank_exits
    worker, per rank
    12. _air.py: with a shipped environment, verify with the           launch.entrypoint_template,
        standard library alone, then rehydrate it                      sparkgpu.env.hydrate
    13. entrypoint: devices, process group, unpickle, run fn, write    launch.entrypoint,
        the signed result or error                                     launch.process_group
    client again
    14. results and errors read back and checked; failures grouped     launch.attempt_result,
        per rank into one error (attach(...).result() reads a          launch.attempt_report,
        finished job the same way); the outcome to the callbacks       launch.supervisor,
                                                                       sparkgpu.errors
"""
