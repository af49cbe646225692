"""Helpers of the test suite: libraries the tests import and programs they start.

Naming: a library is ``<concept>.py``; a program a test starts as its own process is
``<concept>_worker.py`` and runs as ``python -m tests.helpers.<concept>_worker`` from the
repository root, which the spawner also puts on ``PYTHONPATH`` (:mod:`.workers`); an external
agent script is ``<concept>_agent.py`` and runs by its path, as a user's agent command does
(it imports only ``openai``). No helper patches ``sys.path``. Fixtures shared by several test
modules are in tests/conftest.py; data files are in tests/data/, the launcher's stand-in
processes in tests/fixtures_launch/.

Libraries
    bit_flips          corrupt a file in place (checkpoint integrity)
    conversions        the session's HF <-> megatron conversion jobs and 2-rank checkpoint runs
    cpu_extension      build the C++ CPU kernels in place when missing (ops tests)
    group_batches      micro-batches of GRPO-like prompt groups (shared-prefix engine checks)
    local_runs         a ``launch.local`` run of the tiny-cpu recipe: start, finish, read, probe
    lora_layouts       run a :mod:`.lora_worker` scenario on its ranks
    multirank          run a worker as N gloo ranks and read each rank's result
    new_families       the model families checked end to end (one ``FamilyCase`` each)
    openai_episodes    the OpenAI-compatible surface: logit bias, tool template, recording client
    rollout            tiny models, HTTP calls, teacher-forced logprobs, a collecting group sink
    server_pool        checks of the elastic server-pool tests
    slurm_cluster      a throwaway Slurm cluster on this machine
    tracker_readers    read W&B / MLflow runs with the trackers' own tools
    trajectories       deterministic data-plane trajectories
    vllm_env           the vLLM interpreter (skip or fail without one)
    vllm_servers       real vLLM servers on tiny models
    workers            ``python -m tests.helpers.<name>``: argv, environment, one run read back

Workers (programs)
    ckpt_fault_worker      checkpoint saves and resumes for the integrity tests
    compat_probe_worker    upstream megatron-core on CPU with and without our patches
    convert_worker         tiny-model conversion round trips (also their variants and readers)
    cp_loss_worker         context-parallel loss equality (2 ranks)
    critic_worker          critic layouts, GAE, resume and initial weights
    distribute_worker      the trainer's batch distribution over DP / TP ranks
    engine_worker          engine layouts against a single-rank reference
    faulty_teacher_worker  a teacher server that answers 503 once, then NaN, then recovers
    family_bf16_worker     a family's bf16 engine against transformers in fp32 and bf16
    family_worker          a new model family's layouts and HF agreement
    gateway_fd_limit_worker the online gateway alone under a low file descriptor limit
    lora_export_worker     a LoRA run's checkpoint for the export tool
    lora_worker            LoRA on every layout, PEFT interop
    mesh_worker            meshes built one after another (threads per process)
    moe_aux_worker         the MoE load-balancing loss gradient
    moe_family_worker      layouts of the DeepSeek-style MoE families
    mp_checkpoint_worker   2-rank checkpoint load, export, resume and reshard
    nonfinite_worker       non-finite steps and checkpoints on 2 gloo ranks
    routing_replay_worker  routing replay on one rank and on the parallel layouts
    score_critic_worker    a reward model's score head as the critic's start
    sglang_peer_worker     the SGLang side of the weight-update protocol (also importable)
    teacher_forward_worker the teacher's forward as the trainer builds it
    varlen_worker          packed (varlen) attention against the dense-mask path
    vllm_probe_worker      vLLM's parser and app on our server command (vLLM interpreter)

Agents
    counted_agent          outcome decided by the prompt's position (known counts)
    modes_agent            behaviour picked by the prompt item (ok, crash, hang, ...)
    mostly_failing_agent   fails on nearly every task
"""
