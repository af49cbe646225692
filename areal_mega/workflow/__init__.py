"""What one episode does, written against the Workflow API.

- :mod:`.api` -- :class:`EpisodeWorkflow`, :class:`SampleContext`, building a workflow from config;
- :mod:`.builtin` -- single-turn RLVR and multi-turn workflows (``rollout.workflow``);
- :mod:`.tokens` -- :class:`TokenSeq`, the token/logprob/version record of one sequence;
- :mod:`.openai_client`, :mod:`.openai_server` -- the OpenAI-compatible client and HTTP endpoint
  that agent code calls; :mod:`.tool_calls` -- tool-call parsing and templates;
- :mod:`.external_agent` -- any program speaking the OpenAI API, run per sample;
- :mod:`.episode_export` -- an episode's completions as trajectories;
- :mod:`.multitask` -- per-source workflows and rewards (``data.sources``)."""
