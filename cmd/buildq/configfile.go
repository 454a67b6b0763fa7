package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
	"sigs.k8s.io/yaml"
)

// configFileHelp is --config's help.
const configFileHelp = `YAML file of flag values, in sections named as the --help groups (worker, nats, kubernetes, storage, registry, tenants, limits, git, logs), each key a flag's name without "--"; flags and BUILDQ_* variables override it (also BUILDQ_CONFIG)`

// applyConfigFile sets every flag the file at path names that was not set
// on the command line or from the environment (fromEnv). A key that is not
// a flag, or sits in another section than its flag's group, is an error
// naming it: a misspelt setting must not be ignored.
func applyConfigFile(fs *pflag.FlagSet, path string, fromEnv map[string]bool) error {
	raw, err := os.ReadFile(path)
	if err != nil {
		return usageErr("--config: %v", err)
	}
	var doc map[string]map[string]any
	if err := yaml.UnmarshalStrict(raw, &doc); err != nil {
		return usageErr("--config %s: %v (want sections of flag: value)", path, err)
	}
	renamed := deprecatedNames(fs)
	var errs []string
	sections := make([]string, 0, len(doc))
	for s := range doc {
		sections = append(sections, s)
	}
	sort.Strings(sections)
	for _, section := range sections {
		if !slices.ContainsFunc(flagGroups, func(g flagGroup) bool { return g.name == section }) {
			errs = append(errs, fmt.Sprintf("%s: not a section (sections: %s)", section, groupNames()))
			continue
		}
		keys := make([]string, 0, len(doc[section]))
		for k := range doc[section] {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, key := range keys {
			where := section + "." + key
			name := key
			if to, ok := renamed[key]; ok {
				errs = append(errs, fmt.Sprintf("%s: renamed; use %s", where, to))
				continue
			}
			f := fs.Lookup(name)
			if f == nil || name == "config" || name == "help" {
				errs = append(errs, fmt.Sprintf("%s: not a setting of this command", where))
				continue
			}
			if g := groupOf(name); g != section {
				errs = append(errs, fmt.Sprintf("%s: belongs in section %s", where, g))
				continue
			}
			if f.Changed || fromEnv[name] {
				continue
			}
			if err := setFromConfig(f, doc[section][key]); err != nil {
				errs = append(errs, fmt.Sprintf("%s: %v", where, err))
			}
		}
	}
	if len(errs) > 0 {
		return usageErr("--config %s:\n  %s", path, strings.Join(errs, "\n  "))
	}
	return nil
}

func groupNames() string {
	var names []string
	for _, g := range flagGroups {
		names = append(names, g.name)
	}
	return strings.Join(names, ", ")
}

// setFromConfig sets a flag from a YAML value: a scalar as the flag's own
// text, a list for a list flag, a map for a key=value flag.
func setFromConfig(f *pflag.Flag, v any) error {
	switch x := v.(type) {
	case []any:
		sv, ok := f.Value.(pflag.SliceValue)
		if !ok {
			return fmt.Errorf("a list, but --%s takes one %s", f.Name, f.Value.Type())
		}
		items := make([]string, 0, len(x))
		for _, it := range x {
			s, err := scalar(it)
			if err != nil {
				return err
			}
			items = append(items, s)
		}
		return sv.Replace(items)
	case map[string]any:
		if !strings.HasPrefix(f.Value.Type(), "stringTo") {
			return fmt.Errorf("a map, but --%s takes %s", f.Name, f.Value.Type())
		}
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		pairs := make([]string, 0, len(x))
		for _, k := range keys {
			s, err := scalar(x[k])
			if err != nil {
				return err
			}
			pairs = append(pairs, k+"="+s)
		}
		return f.Value.Set(strings.Join(pairs, ","))
	default:
		s, err := scalar(v)
		if err != nil {
			return err
		}
		if sv, ok := f.Value.(pflag.SliceValue); ok {
			return sv.Replace(splitList(s))
		}
		return f.Value.Set(s)
	}
}

func scalar(v any) (string, error) {
	switch x := v.(type) {
	case string:
		return x, nil
	case bool:
		return strconv.FormatBool(x), nil
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), nil
	case json.Number:
		return x.String(), nil
	case nil:
		return "", nil
	default:
		return "", fmt.Errorf("%v is not a single value", v)
	}
}
