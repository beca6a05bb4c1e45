"""The AR stages: their decode loops, and the processes they run in.

- :mod:`.runner`: ``StageRunner``, the decode loop of one AR stage (the critical path);
- :mod:`.assembly`: ``build_stages``, each stage's guard decision, the arena,
  the materializer link and the runners, built the same way in the
  decoder's process and in a stage process;
- :mod:`.host`: a stage process, the child side (``stage_main``);
- :mod:`.proxy`: a stage process seen from the decoder (``StageProcess``);
  :mod:`.facts`: the engine facts its process reported, as a backend's
  attributes; :mod:`.launch`: ``stage_specs`` and ``launch_stages``;
- :mod:`.liveness`: the stages under the decoder's watchdog;
- :mod:`.messages`: what crosses a stage process's pipes (typed messages)
  and what it is started with (``StageHostSpec``).
"""
