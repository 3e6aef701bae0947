"""``load.studies``: studies measured through real deployments: MICO's study, the planned fleet, deadlines, prefixes, the WAN, policies, offloading."""
