"""The launcher: from a decorated call on the client to ranks on the workers, and back.

How one call runs, hop by hop (``spark.gpu.train(fn, data=df, ...)`` or ``fn.distributed(...)``
of a ``@distributed`` function), with the module doing each::

    client
     1. spark.gpu.train: checks its arguments, takes this session's    sparkgpu.api.spark_gpu
        Spark backend; with data=, prepares the job (hops 3-5,
        nothing written), then turns the data into MDS shards on the    sparkgpu.data.convert
        executors (or reads the table in place), adds data_url to the
        prepared arguments and goes on at hop 6 with that same job
     2. .distributed(): the frozen JobSpec, then prepare() runs         sparkgpu.api.decorator, .spec,
        hops 3-5 once (a dryrun stops there: the plan, nothing          sparkgpu.api.prepare
        written) and PreparedJob.write() hops 6-7
     3. backend.place (Spark: the GPU pool, whose usage policy is      launch.backends.local.backend,
        checked at once), then backend.resolve: capacity, gpu_type     launch.backends.spark.backend,
        and rank placement within seconds (Spark: a probe job on the   .capacity, .executor.probe;
        executors)                                                     sparkgpu.spec.pools
     4. callbacks (tracking, metering) and the usage policy            sparkgpu.callbacks,
                                                                       sparkgpu.tracking, .usage
     5. the function, arguments and callbacks pickled                  sparkgpu.rundir.serialization
     6. with shipping: environment snapshot, staged by content         sparkgpu.env
     7. the run dir written and signed: _air.py, spec.json,            sparkgpu.rundir.directory,
        payload.pkl (+ _hydrate.py, _errors.py), payload.sig;          .layout, .entrypoint_template,
        the job key kept in this user's keyring                        .signature, .key_handover,
                                                                       .keyring
     8. the supervisor's attempt loop: submit, watch, stream the       launch.client.supervisor,
        ranks' logs, restart or raise; state.json for `resume` (its    .attempt_runner, .logs, .resume;
        job, attempt and node states, the node exit record). The       sparkgpu.rundir.states;
        local backend starts the first agent beside the callbacks'     launch.scheduling (GPU
        before_job (backend.prestart) and hands it their variables     queues, leases, elastic)
     9. backend.submit: one node agent here, a warm-pool fork (also    launch.backends.local
        a restart's fork from the job's standby), or one Spark         (.backend, .warm,
        barrier task per node (the run dir mirrored to an object       .zygote_client, .zygote),
        store when the staging root is one); on Spark, lost nodes      launch.backends.spark,
        stop the others and the attempt's report says how each ended   launch.staging.mirror
    worker, per node
    10. Spark node task: verify the payload, start the agent, watch    launch.backends.spark
        it, beat for the client and the peer nodes                     .executor (.node, .hub)
    11. node agent: verify, preload the libraries the function         launch.node.agent,
        imports, fork one spare per rank (a shipped environment        .forked_ranks,
        rehydrated and compared first), rendezvous, start the ranks    .shipped_overlay,
        (the spares, or new interpreters) with the verified _air.py    .rendezvous, .rank_exits,
        text, record how each exits                                    .preload
    worker, per rank
    12. _air.py: with a shipped environment, verify with the           sparkgpu.rundir
        standard library alone, then rehydrate it                      .entrypoint_template,
                                                                       sparkgpu.env.hydrate
    13. entrypoint: devices, process group, unpickle, run fn, write    launch.rank.entrypoint,
        the signed result or error                                     .process_group
    client again
    14. results and errors read back and checked; failures grouped     launch.client
        per rank into one error (attach(...).result() reads a          .attempt_verdict,
        finished job the same way); the outcome to the callbacks       .attempt_report,
                                                                       .supervisor; sparkgpu.errors

Each sub-package is named for where its code runs: ``client`` (the caller's process),
``scheduling`` (who gets GPUs when, decided on the client), ``staging`` (the run dir's mirror on
a staging store, kept by the client and by each Spark node), ``node`` (once per node, beside its ranks),
``rank`` (inside each rank), ``backends`` (where a job runs: ``local``, and ``spark`` whose
``executor`` sub-package is what runs inside the Spark tasks). Rank, node and executor code never
imports client code (``tests/unit/test_layering.py``). The run dir's format itself, which the
ranks' libraries read too, is :mod:`sparkgpu.rundir`, below the launcher.
"""
