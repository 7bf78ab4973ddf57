"""The CLI subcommands that are not a package of their own (generate, chat, check, ppl, plan)."""
