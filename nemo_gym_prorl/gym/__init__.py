"""NeMo Gym glue. This folder is a Gym plugin root: Gym finds `resources_servers/prorl_math/` (and the benchmark's
`prorl_bench`), `responses_api_agents/prorl_service/` (a relay to a running `prorl serve`),
`responses_api_agents/prorl_agent/` (the service inside the agent's own process) and `env.yaml` here when
it is on `NEMO_GYM_EXTRA_ROOTS` (or given with `--search-dir`). The modules beside them are what those
servers share: dataset rows (`rows`), live episodes by session (`sessions`), submitted answers (`answers`), our
agents' shared routes (`rollout_agent`), the policy's servers from Gym's global config (`policy`) and the venv links
that let Gym start servers offline (`venvs`). See README.md for the commands.
"""

from pathlib import Path

PLUGIN_ROOT = Path(__file__).resolve().parent
