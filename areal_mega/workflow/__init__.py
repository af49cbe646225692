"""What one episode does, written against the Workflow API.

- :mod:`.api` -- :class:`EpisodeWorkflow`, :class:`SampleContext` (what one sample's episode
  sees; it wraps the controller's :class:`~areal_mega.rollout.controller.GroupContext`),
  building a workflow from config;
- :mod:`.builtin` -- single-turn RLVR and multi-turn workflows (``rollout.workflow``);
- :mod:`.tokens` -- :class:`TokenSeq`, the token/logprob/version record of one sequence;
- :mod:`.openai_client`, :mod:`.openai_server` -- the OpenAI-compatible client and HTTP endpoint
  that agent code calls; :mod:`.tool_calls` -- tool-call parsing and templates;
- :mod:`.external_agent` -- any program speaking the OpenAI API, run per sample;
- :mod:`.episode_export` -- an episode's completions as trajectories;
- :mod:`.multitask` -- per-source workflows and rewards (``data.sources``);
- :mod:`.online_gateway` -- online RL (``rollout.workflow: online``): the HTTP gateway that
  agents areal-mega does not start call, their sessions trained;
- :mod:`.online_sessions` -- the gateway's session book: sessions, task groups, lifetimes (pure);
- :mod:`.online_journal` -- the gateway's journal (a killed worker loses no ended session);
- :mod:`.online_restore` -- online sessions as samples, and the ended sessions a restarted
  worker still waits on."""
