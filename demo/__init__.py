"""The actor-learner demo: a weight server, a DDPG trainer and torchrl collectors on PendulumEnv.

`python -m demo` (what `scripts/demo.sh` runs) starts all of them on one machine;
`docker/compose.yaml` runs the same trainer and collector modules as services. Modules:

* `demo.run`: the orchestrator (server, trainer, collectors as child processes; summary).
* `demo.trainer`: DDPG on the spool's experience, publishing through `PublishWeights`.
* `demo.collector`: a torchrl `Collector` pulling weights through `GrpcWeightSyncScheme`.
* `demo.spool`: the directory of TensorDict memmaps that carries experience to the trainer.
* `demo.models`: PendulumEnv, the DDPG actor and critic, the collectors' exploring policy.
* `demo.config`: every setting as a flag and an environment variable, with its default.
* `demo.summary`, `demo.output`, `demo.lifecycle`, `demo.processes`, `demo.jsonfile`: the
  end-of-run summary, progress lines, signals, child processes, atomic JSON files.
* `demo.plot`: the end-of-run PNG (episode reward, collector lag, freshness over time; matplotlib,
  needed by the orchestrator only).
* `demo.roundtrip`: the earlier publish / watch / fetch / restart walk-through.
"""
